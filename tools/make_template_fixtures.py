#!/usr/bin/env python3
"""Writes tests/fixtures/templates/cases.jsonl: chat-template renders by transformers'
apply_chat_template(tokenize=False), the reference tests/unit/test_chat_template.cpp compares
against byte for byte. Deterministic: fixed conversations, no clock (no template here calls
strftime_now).

Templates: "qwen3" (chat_template of tests/fixtures/tokenizer/qwen3/tokenizer_config.json),
"qwen3_5" and "qwen2_5" (tests/fixtures/templates/*.jinja, sources in README.md there).
One JSON object per line: {"template", "name", "messages", "tools", "add_generation_prompt",
"enable_thinking" (null: not passed), "extra" (the special tokens transformers passes),
"expected": str} or, where transformers raises, "error": its message instead of "expected".

Usage: python3 tools/make_template_fixtures.py [--out PATH]
"""
import argparse
import json
import os

from transformers import AutoTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..')
TOK_DIR = os.path.join(ROOT, 'tests/fixtures/tokenizer/qwen3')
TPL_DIR = os.path.join(ROOT, 'tests/fixtures/templates')

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Températures en °C — 天气",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\nReturns up to `k` results.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer", "default": 5}},
                       "required": ["query"]},
    },
}
TOOLS = [WEATHER_TOOL, SEARCH_TOOL]


def call(name, args, wrap=True):
    c = {"name": name, "arguments": args}
    return {"type": "function", "id": "call_" + name, "function": c} if wrap else c


SYS = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "Hello!"}
A1 = {"role": "assistant", "content": "Hi! How can I help you today?"}

CONVERSATIONS = [
    ("user_only", [U1], None),
    ("system_user", [SYS, U1], None),
    ("multi_turn", [SYS, U1, A1, {"role": "user", "content": "Tell me a joke."},
                    {"role": "assistant", "content": "Why did the chicken cross the road?"},
                    {"role": "user", "content": "Why?"}], None),
    ("think_in_content", [U1, {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello there!"},
                          {"role": "user", "content": "And again?"}], None),
    ("think_last_turn", [U1, {"role": "assistant", "content": "<think>\nplan\n\n</think>\n\n\nFinal."}], None),
    ("reasoning_field", [U1, {"role": "assistant", "content": "Answer.", "reasoning_content": "\nSome reasoning.\n"},
                         {"role": "user", "content": "ok"}, {"role": "assistant", "content": "Done.", "reasoning_content": "r2"}], None),
    ("tools_user", [{"role": "user", "content": "What's the weather in Paris?"}], TOOLS),
    ("tools_system_user", [SYS, {"role": "user", "content": "Search for jinja docs"}], TOOLS),
    ("tool_call_roundtrip", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 21.5 °C and clear in Paris."}], TOOLS),
    ("tool_call_string_args", [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", "{\"city\": \"Oslo\"}")]},
        {"role": "tool", "content": "cold"}], TOOLS),
    ("parallel_tool_calls", [
        {"role": "user", "content": "Weather in Paris and Rome, and search news"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("get_weather", {"city": "Paris"}), call("get_weather", {"city": "Rome", "days": 3}),
            call("search", {"query": "news", "k": 2})]},
        {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "rainy"},
        {"role": "tool", "content": "[\"a\", \"b\"]"},
        {"role": "assistant", "content": "Paris: sunny. Rome: rainy."}], TOOLS),
    ("unwrapped_tool_call", [
        {"role": "user", "content": "Search cats"},
        {"role": "assistant", "content": None, "tool_calls": [call("search", {"query": "cats"}, wrap=False)]},
        {"role": "tool", "content": "cats are great"}], TOOLS),
    ("multi_step_tools", [
        SYS, {"role": "user", "content": "Plan a trip"},
        {"role": "assistant", "content": "<think>\nneed weather\n</think>\n\n", "tool_calls": [call("get_weather", {"city": "Lima"})]},
        {"role": "tool", "content": "warm"},
        {"role": "assistant", "content": "", "tool_calls": [call("search", {"query": "Lima hotels"})]},
        {"role": "tool", "content": "Hotel A"},
        {"role": "assistant", "content": "<think>\nsummarize\n</think>\n\nGo to Lima, stay at Hotel A."}], TOOLS),
    ("arg_types", [
        {"role": "user", "content": "types"},
        {"role": "assistant", "content": "", "tool_calls": [call("search", {
            "query": "x", "k": 3, "ratio": 0.1, "big": 1e20, "small": 1.5e-7, "flag": True, "off": False, "nothing": None,
            "list": [1, "two", 3.0, [4]], "obj": {"z": 1, "a": {"b": "c"}}, "quote": "say \"hi\"\\n", "uni": "ünï 😀"})]},
        {"role": "tool", "content": "ok"}], TOOLS),
    ("unicode_content", [
        {"role": "system", "content": "Réponds en français. 用中文回答。"},
        {"role": "user", "content": "Emoji 👨‍👩‍👧 and tabs\tand \"quotes\" and \\backslashes\\ and\r\nCRLF"}], None),
    ("whitespace_content", [{"role": "user", "content": "  leading and trailing  \n\n"},
                            {"role": "assistant", "content": "\n\n  padded answer  \n"},
                            {"role": "user", "content": "\u3000ideographic space\u3000"}], None),
    ("tool_response_in_user", [
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\nanswer"},
        {"role": "user", "content": "<tool_response>\nresult\n</tool_response>"},
        {"role": "assistant", "content": "<think>\ny\n</think>\n\nsecond"}], None),
    ("long_history", [SYS] + [m for k in range(6) for m in (
        {"role": "user", "content": f"question {k}"},
        {"role": "assistant", "content": f"<think>\nthinking {k}\n</think>\n\nanswer {k}"})] +
     [{"role": "user", "content": "last"}], None),
    ("system_in_middle", [U1, {"role": "system", "content": "late system"}, {"role": "user", "content": "hm"}], None),
    ("content_parts", [{"role": "user", "content": [{"type": "text", "text": "Look at this: "}, {"type": "image"},
                                                     {"type": "text", "text": " and this video"}, {"type": "video"}]}], None),
    ("assistant_only", [{"role": "assistant", "content": "I speak first."}], None),
    ("unknown_role", [{"role": "developer", "content": "dev note"}, U1], None),
    ("empty_tools_list", [U1], []),
    ("assistant_content_none", [U1, {"role": "assistant", "content": None}], None),
]


# Small templates exercising one feature each (whitespace control, Python semantics of filters,
# tests, methods, slicing, loops, macros), rendered by the same jinja2 setup with messages=[U1].
SNIPPETS = [
    "a  {%- if true %}  b  {% endif -%}  c",
    "x\n  {% if true %}\n  y\n  {% endif %}\nz\n",
    "{% for i in range(3) %}\n  {{ i }}\n{% endfor %}\n",
    "  {#- comment -#}  q  {# c2 #}\n  r",
    "{%+ if true %}  kept{% endif +%}\nnext",
    "{{ 'a' ~ 1 ~ 2.5 ~ none ~ true }}|{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 1.0 }} {{ 3 * 'ab' }}",
    "{{ [1, 2, 3][::-1] }} {{ 'héllo'[1:3] }} {{ 'abc'[-1] }} {{ [1,2,3,4,5][1:4:2] }} {{ 'abcdef'[::-2] }} {{ 'x'[5:] }}",
    "{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\n\nq\n'.lstrip('\n') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(' ', 1) }}|{{ 'a b c'.rsplit(' ', 1) }}",
    "{{ 'Hello'.upper() }} {{ 'ÉCOLE Straße'.lower() }} {{ 'straße'.upper() }} {{ 'hello world'.title() }} {{ 'hELLO'.capitalize() }} {{ 'aaa'.replace('a', 'b', 2) }} {{ 'abc'.startswith(('x', 'a')) }} {{ 'abc'.endswith('bc') }} {{ 'banana'.find('n') }} {{ 'banana'.count('an') }}",
    "{{ messages | length }} {{ 'héllo' | length }} {{ {'a': 1} | length }} {{ [3, 1, 2] | sort }} {{ [1, 2, 2, 3] | unique | list }} {{ 'abc' | reverse }} {{ [1, 2] | first }} {{ [1, 2] | last }}",
    "{{ ['a', 'b'] | join(', ') }}|{{ [{'n': 'x'}, {'n': 'y'}] | map(attribute='n') | join }}|{{ ['a', 'b'] | map('upper') | list }}|{{ undefined_var | default('dflt') }}|{{ '' | default('empty', true) }}|{{ none | string }}|{{ 3.0 | int }}|{{ '4' | int + 1 }}|{{ '2.5' | float }}",
    "{{ [{'r': 'u', 'x': 1}, {'r': 'a'}, {'r': 'u', 'x': 2}] | selectattr('r', 'equalto', 'u') | map(attribute='x') | list }} {{ [0, 1, '', 'a', none] | select | list }} {{ [1, 2, 3, 4] | reject('odd') | list }} {{ [{'x': 1}, {}] | rejectattr('x') | list }}",
    "{{ {'b': 1, 'a': [1, 2.5, none, true, 'é\n\"']} | tojson }}|{{ {'b': 1, 'a': 2} | tojson(indent=2) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ 'é😀' | tojson(ensure_ascii=true) }}|{{ [1, [2, {}], []] | tojson(indent=1) }}|{{ {'a': 1} | tojson(separators=(',', ':')) }}",
    "{% for k, v in {'b': 1, 'a': 2} | items %}{{ k }}={{ v }};{% endfor %}{% for k, v in {'x': 'y'}.items() %}{{ k }}{{ v }}{% endfor %}{% for k in {'p': 1, 'q': 2} %}{{ k }}{% endfor %}",
    "{% for x in [1, 2, 3, 4] if x is odd %}{{ loop.index }}/{{ loop.length }}:{{ x }}{{ ',' if not loop.last }}{% endfor %}{% for x in [] %}no{% else %}empty{% endfor %}",
    "{% for x in ['a', 'b', 'c'] %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}",
    "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% endif %}{{ x }}{% endfor %}",
    "{% set ns = namespace(n=0, s='') %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% set ns.s = ns.s ~ i %}{% set local = i %}{% endfor %}{{ ns.n }} {{ ns.s }} {{ local is defined }}",
    "{% macro greet(name, punct='!') -%}\n  Hello {{ name }}{{ punct }}\n{%- endmacro %}[{{ greet('Ann') }}][{{ greet('Bob', punct='?') }}][{{ greet('Cy') | upper }}]",
    "{% set x %}  block {{ 1 + 1 }}  {% endset %}[{{ x }}][{{ x | trim }}]",
    "{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ 1.5 is float }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}{{ none is none }}{{ x is undefined }}{{ 4 is divisibleby 2 }}{{ 3 is even }}{{ true is true }}{{ 1 is true }}{{ 'a' is in 'abc' }}{{ 'abc' is lower }}",
    "{{ 1 == 1.0 }}{{ true == 1 }}{{ 'a' < 'b' }}{{ [1, 2] < [1, 3] }}{{ 'b' in ['a', 'b'] }}{{ 'k' in {'k': 1} }}{{ 'z' not in 'abc' }}{{ none == none }}{{ (1, 2) == [1, 2] }}",
    "{{ 'yes' if messages else 'no' }} {{ 'x' if false }}|{{ (messages[0].content ~ '!') if messages[0].content is defined else 'none' }}|{{ messages[0]['role'] }} {{ messages[0].get('missing', 'd') }} {{ messages[0].missing is defined }}",
    r"""{{ {'a': [1, 'b', none, true, 1.5]} }} {{ ["it's", 'say "x"', 'both \\ ', '\t'] }} {{ none }} {{ undefined_thing }}""",
]


def variants():
    yield False, None
    yield True, None
    yield True, True
    yield True, False


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--out', default=os.path.join(TPL_DIR, 'cases.jsonl'))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(TOK_DIR)
    templates = {
        'qwen3': tok.chat_template,
        'qwen3_5': open(os.path.join(TPL_DIR, 'qwen3_5.jinja'), encoding='utf-8').read(),
        'qwen2_5': open(os.path.join(TPL_DIR, 'qwen2_5.jinja'), encoding='utf-8').read(),
    }
    extra = dict(tok.special_tokens_map)
    n = n_err = 0
    with open(args.out, 'w', encoding='utf-8', newline='\n') as f:
        for tname, tsrc in templates.items():
            for name, messages, tools in CONVERSATIONS:
                for agp, thinking in variants():
                    kwargs = {} if thinking is None else {'enable_thinking': thinking}
                    rec = {'template': tname, 'name': name, 'messages': messages, 'tools': tools,
                           'add_generation_prompt': agp, 'enable_thinking': thinking, 'extra': extra}
                    try:
                        rec['expected'] = tok.apply_chat_template(messages, tools=tools, chat_template=tsrc,
                                                                  add_generation_prompt=agp, tokenize=False, **kwargs)
                    except Exception as e:  # the template rejects this conversation: we must too
                        rec['error'] = f'{type(e).__name__}: {e}'
                        n_err += 1
                    f.write(json.dumps(rec, ensure_ascii=False) + '\n')
                    n += 1
        for k, src in enumerate(SNIPPETS):
            rec = {'template': 'inline', 'source': src, 'name': f'snippet_{k}', 'messages': [U1], 'tools': None,
                   'add_generation_prompt': False, 'enable_thinking': None, 'extra': extra}
            try:
                rec['expected'] = tok.apply_chat_template([U1], chat_template=src, tokenize=False)
            except Exception as e:
                rec['error'] = f'{type(e).__name__}: {e}'
                n_err += 1
            f.write(json.dumps(rec, ensure_ascii=False) + '\n')
            n += 1
    print(f'wrote {n} cases ({n_err} expected errors) to {args.out}')


if __name__ == '__main__':
    main()
