#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer/cases.jsonl: varied strings with the ids and decoded text that
Hugging Face `tokenizers` gives for them, the reference tests/unit/test_tokenizer.cpp checks against.

Deterministic (fixed seed, no clock or environment input). One JSON object per line:
  {"i": n, "cat": category, "text": str | "hex": raw bytes (invalid UTF-8 only),
   "special": bool (false = special tokens encoded as text), "ids": [...],
   "decoded": HF decode(ids), "decoded_skip": HF decode(ids, skip_special_tokens=True)}
Invalid UTF-8 cannot be handed to HF (its encode takes a Rust &str; a Python str with lone
surrogates raises TypeError), so for "hex" cases HF encodes bytes.decode("utf-8", "replace"):
one U+FFFD per maximal invalid subpart. That is the behaviour our tokenizer implements.

Usage: python3 tools/make_tokenizer_fixtures.py [--tokenizer PATH] [--out PATH]
"""
import argparse
import json
import random
import unicodedata

from tokenizers import Tokenizer

SEED = 20261129

CODE = [
    'def fib(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n',
    'import numpy as np\n\nx = np.arange(10_000).reshape(100, 100)\nprint(f"{x.sum():,}")\n',
    '#include <vector>\n#include <cstdint>\n\nint main(int argc, char** argv) {\n  std::vector<int32_t> v{1, 2, 3};\n  for (auto& x : v) x *= 2;\n  return v.size() == 3 ? 0 : 1;\n}\n',
    'template <typename T>\nstruct Result {\n  T value;\n  bool ok() const noexcept { return ok_; }\n};\n',
    'fn main() {\n    let v: Vec<u64> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}\n',
    'impl<T: Clone> From<&[T]> for Vec<T> {\n    fn from(s: &[T]) -> Vec<T> { s.to_vec() }\n}\n',
    'const add = (a, b) => a + b;\nexport default async function handler(req, res) {\n  const { id } = req.query;\n  res.status(200).json({ id, ok: true });\n}\n',
    'package main\n\nimport "fmt"\n\nfunc main() {\n\tch := make(chan int, 3)\n\tgo func() { ch <- 42 }()\n\tfmt.Println(<-ch)\n}\n',
    'SELECT u.id, COUNT(*) AS n\nFROM users u\nJOIN orders o ON o.user_id = u.id\nWHERE o.created_at >= \'2024-01-01\'\nGROUP BY u.id\nHAVING n > 10;\n',
    '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>Test &amp; page</title></head>\n<body><div class="x">Hello</div></body>\n</html>\n',
    '#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.txt; do\n  wc -l "$f" | awk \'{print $1}\'\ndone\n',
    '{"name": "cherenkov", "version": "0.1.0", "deps": {"fmt": ">=9"}, "list": [1, 2.5, -3e10, null, true]}',
    'public class Main {\n    public static void main(String[] args) {\n        System.out.println("Hello, " + args[0]);\n    }\n}\n',
    '    if (x != NULL && *x == \'\\0\') {\n\t\treturn -EINVAL;\n\t}\n',
    'λx. (x x) (λy. y) -- Haskell: map (\\x -> x * 2) [1..10]\n',
    '\\begin{equation}\n  E = mc^2, \\quad \\int_0^\\infty e^{-x^2}\\,dx = \\frac{\\sqrt{\\pi}}{2}\n\\end{equation}\n',
    'diff --git a/x.py b/x.py\n@@ -1,3 +1,4 @@\n-old line\n+new line\n+another\n',
    '    ```python\n    print("nested")\n    ```\n',
]

PROSE = [
    'The quick brown fox jumps over the lazy dog.',
    "It's a truth universally acknowledged. They'll say we'd've done it; you're right, I'm sure.",
    "IT'S LOUD. WE'LL SEE. THEY'VE GONE. I'D KNOW. YOU'RE HERE. SHE'S OK. DON'T.",
    'Mr. Smith paid $1,234.56 on 2024-03-15 at 10:45pm (approx. 3.5% interest).',
    'Numbers: 0 1 12 123 1234 12345 123456 1234567 3.14159265358979 -42 +7 1e-9 0x1F 0b1010',
    'Version 3.12.1-rc2+build.7 released; see https://example.com/path?a=1&b=two#frag',
    'email: someone.else+tag@example.co.uk, phone +1 (555) 010-9999',
    'Hello world!!! ??? ... --- *** ### @@@ ~~~ ^^^ &&& ||| ;;; ::: ,,,',
    'Ünïcödé àccents: café naïve résumé façade Ångström Øresund Straße Œuvre',
    'Привет, мир! Как дела? Ёлка и щи.',
    'Γειά σου Κόσμε· αβγδεζηθ ΑΒΓΔ',
    'مرحبا بالعالم، كيف حالك؟ ١٢٣٤٥',
    'שלום עולם! מה שלומך?',
    'नमस्ते दुनिया। यह एक परीक्षण है। ०१२३',
    'สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ',
    'Xin chào thế giới! Tiếng Việt có nhiều dấu.',
    'Merhaba dünya! İstanbul ılık; ĞÜŞİÖÇ ğüşıöç',
    'Witaj świecie! Zażółć gęślą jaźń.',
    'ქართული ენა — Հայերեն լեզու — ᏣᎳᎩ — ⴰⵎⴰⵣⵉⵖ',
]

CJK = [
    '你好，世界！今天天气很好，我们去公园散步吧。',
    '机器学习是人工智能的一个分支，它使计算机能够从数据中学习。',
    '「東京」は日本の首都です。ひらがな、カタカナ、漢字を使います。',
    'ｶﾀｶﾅ 半角カナ と 全角ＡＢＣ１２３ の混在。',
    '안녕하세요, 세계! 한국어는 한글로 씁니다.',
    '繁體中文：臺灣的電腦軟體與網路。',
    '数字１２３と123、記号！？（）【】《》——……',
    '𠀀𠀁𪚥𤭢 (CJK Extension B) 〇〡〢',
]

EMOJI = [
    '😀😃😄😁😆😅🤣😂🙂🙃',
    '👍🏻👍🏼👍🏽👍🏾👍🏿',
    '👨‍👩‍👧‍👦 family, 👩‍💻 technologist, 🏳️‍🌈 flag, 🧑🏽‍🚀 astronaut',
    '🇺🇸🇯🇵🇨🇳🇩🇪🇫🇷 flags',
    '❤️ ♥ ☺️ ✔️ ✖ ⭐ 🌟 ✨',
    'keycaps: 1️⃣ 2️⃣ #️⃣ *️⃣',
    '🏴󠁧󠁢󠁳󠁣󠁴󠁿 scotland tag sequence',
    'I ❤️ 🍕 and 🍣!!! 🎉🎉🎉',
]

COMBINING = [
    'e\u0301 a\u0300 o\u0308 n\u0303 c\u0327',            # decomposed: NFC composes them
    'cafe\u0301 nai\u0308ve re\u0301sume\u0301',
    '\u1100\u1161\u11a8 \u1112\u1161\u11ab',                # Hangul jamo -> syllables
    'Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O\u0342\u030c\u030c\u0358\u0328\u0335\u0339\u033b\u031d\u0333',
    'A\u030a \u212b \u00c5',                                # three spellings of Å
    '\u0041\u0323\u0307 \u1e0c\u0307 \u0044\u0307\u0323',    # reordering of combining marks
    '\u0915\u093c \u0958',                                  # Devanagari nukta (composition exclusion)
    '\ufb01 \ufb02 \u2126 \u212a \u00b5 \u03bc',            # compatibility chars: NFC keeps most
    '\u0340\u0341\u0343\u0344 \u0374 \u037e \u0387',        # NFC_QC=No singletons
    'x\u0307\u0323y a\u0328\u0301',
]

WHITESPACE = [
    ' ', '  ', '   ', '\t', '\t\t', '\n', '\n\n', '\r\n', '\r', '\r\n\r\n', ' \n ', '\n \n',
    '\u00a0', '\u2028', '\u2029', '\u3000', '\u0085', '\u200b', '\ufeff', '\x0b', '\x0c',
    '\x1c', '\x1d', '\x1e', '\x1f', '\u1680', '\u2000', '\u2009', '\u200a', '\u202f', '\u205f',
    '\u180e', '\u200c', '\u200d', '\u2060',
]

SPECIALS = ['<|im_start|>', '<|im_end|>', '<|endoftext|>', '<think>', '</think>', '<tool_call>',
            '</tool_call>', '<tool_response>', '</tool_response>', '<|fim_prefix|>', '<|fim_middle|>',
            '<|fim_suffix|>', '<|vision_start|>', '<|image_pad|>', '<|vision_end|>', '<|box_start|>',
            '<|repo_name|>', '<|file_sep|>', '<|im_start', 'im_end|>', '<|', '|>', '<<|im_end|>>',
            '<|im_start|><|im_end|>', '<think></think>']

WORDS = ('the of and to in is you that it he was for on are as with his they at be this have from '
         'or one had by word but not what all were we when your can said there use an each which she '
         'do how their if will up other about out many then them these so some her would make like him '
         'into time has look two more write go see number no way could people my than first water been '
         'call who oil its now find long down day did get come made may part tokenizer transformer '
         'über naïve façade résumé Zürich São Paulo Kraków').split()

INVALID = [
    b'\xff', b'\xfe\xff', b'abc\x80def', b'\xc3', b'\xc3(', b'\xe2\x82', b'\xe2\x82(', b'\xf0\x9f\x98',
    b'\xf0\x9f\x98 x', b'\xed\xa0\x80', b'\xed\xbf\xbf surrogate', b'\xc0\xaf overlong', b'\xe0\x80\xaf',
    b'\xf4\x90\x80\x80 too big', b'\xf5\x80\x80\x80', b'hello \xc3\xa9\xc3 world', b'\x80\x80\x80\x80',
    b'\xc2\xa0\xc2', b'ok\xe4\xbd\xa0\xe5\xa5', b'<|im_start|>\xff<|im_end|>', b'\xf0\x90\x80',
    b'\xe1\x80\xe1\x80\x80', b'trailing \xe6\x97',
]


def random_codepoint(rng):
    """An assigned, non-surrogate, non-private-use code point (Python's Unicode tables)."""
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0xDFF),
              (0x1100, 0x11FF), (0x1E00, 0x1FFF), (0x2000, 0x2BFF), (0x3000, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF),
              (0x10000, 0x1007F), (0x1D400, 0x1D7FF), (0x20000, 0x2A6DF)]
    while True:
        lo, hi = rng.choice(ranges)
        cp = rng.randint(lo, hi)
        if unicodedata.category(chr(cp)) not in ('Cn', 'Cs', 'Co'):
            return chr(cp)


def fragments(rng):
    pool = rng.choice([CODE, PROSE, CJK, EMOJI, COMBINING, WHITESPACE, SPECIALS, None, None])
    if pool is None:
        kind = rng.randrange(5)
        if kind == 0:
            return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        if kind == 1:
            return ''.join(rng.choice('0123456789') for _ in range(rng.randint(1, 40)))
        if kind == 2:
            return ''.join(random_codepoint(rng) for _ in range(rng.randint(1, 20)))
        if kind == 3:
            return rng.choice(' \t\n\r') * rng.randint(1, 30)
        return rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'LL",
                           "'ſ", "'ſt", "’s", "'x", "'"]) + rng.choice(['', ' ', 'abc', '1', '!'])
    s = rng.choice(pool)
    if len(s) > 40 and rng.random() < 0.5:  # a random slice, so splits land anywhere
        a = rng.randrange(len(s))
        s = s[a:a + rng.randint(1, 60)]
    return s


def make_cases():
    rng = random.Random(SEED)
    cases = []

    def add(cat, text=None, raw=None, special=True):
        cases.append({'cat': cat, 'text': text, 'raw': raw, 'special': special})

    add('empty', '')
    for s in CODE: add('code', s)
    for s in PROSE: add('prose', s)
    for s in CJK: add('cjk', s)
    for s in EMOJI: add('emoji', s)
    for s in COMBINING: add('combining', s)
    for w in WHITESPACE:
        for ctx in ['{}', 'a{}b', 'a {}b', 'a{} b', '{}{}x', 'x{}{}', '{} {}', '\n{}\n', 'a{}\nb']:
            add('whitespace', ctx.replace('{}', w))
    for n in [1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 257, 1000]:
        for ch in [' ', '\t', '\n', '\r\n', ' \n', '\t ', '.', '-', '=', '0', 'a', '你', '😀']:
            add('runs', 'x' + ch * n + 'y')
            add('runs', ch * n)
    for n in range(1, 25):
        add('digits', ''.join(str((i * 7 + n) % 10) for i in range(n)))
        add('digits', 'v' + '9' * n + '.' + '0' * (n % 5))
    for sp in SPECIALS:
        for ctx in ['{}', 'a{}b', ' {} ', '{}{}', 'x\n{}\ny', '{}hello', 'hello{}', '\n\n{}\n\n']:
            add('special', ctx.replace('{}', sp))
            add('special-as-text', ctx.replace('{}', sp), special=False)
    add('chat', '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi! 你好 👋<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n')
    add('chat-as-text', '<|im_start|>user\nignore <|im_end|> this<|im_end|>', special=False)
    for raw in INVALID:
        add('invalid', raw=raw)
    for i in range(60):
        raw = bytearray(rng.choice(PROSE + CJK + EMOJI).encode())
        for _ in range(rng.randint(1, 4)):
            raw.insert(rng.randrange(len(raw) + 1), rng.randrange(256))
        if rng.random() < 0.5 and len(raw) > 2:
            raw = raw[:rng.randrange(1, len(raw))]  # cut, maybe inside a character
        add('invalid-random', raw=bytes(raw))

    # Mixes of everything, most of the corpus.
    while len(cases) < 2400:
        n = rng.randint(1, 8)
        s = ''.join(fragments(rng) for _ in range(n))
        add('mix', s, special=rng.random() > 0.1)
    # A few long documents, to exercise long pieces and the cache.
    for k in range(6):
        add('long', ''.join(fragments(rng) for _ in range(300 + 100 * k)))
    add('long', 'a' * 5000 + ' ' * 5000 + '\n' * 3000 + '1' * 2000)
    add('long', ''.join(chr(0x4E00 + (i * 37) % 20000) for i in range(4000)))
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tokenizer', default='tests/fixtures/tokenizer/qwen3/tokenizer.json')
    ap.add_argument('--out', default='tests/fixtures/tokenizer/cases.jsonl')
    args = ap.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    tok_text = Tokenizer.from_file(args.tokenizer)
    tok_text.encode_special_tokens = True
    cases = make_cases()
    with open(args.out, 'w', encoding='utf-8', newline='\n') as f:
        for i, c in enumerate(cases):
            if c['raw'] is not None:
                text = c['raw'].decode('utf-8', 'replace')
            else:
                text = c['text']
            t = tok if c['special'] else tok_text
            ids = t.encode(text, add_special_tokens=False).ids
            rec = {'i': i, 'cat': c['cat']}
            if c['raw'] is not None:
                rec['hex'] = c['raw'].hex()
            else:
                rec['text'] = text
            rec['special'] = c['special']
            rec['ids'] = ids
            rec['decoded'] = tok.decode(ids, skip_special_tokens=False)
            rec['decoded_skip'] = tok.decode(ids, skip_special_tokens=True)
            f.write(json.dumps(rec, ensure_ascii=False) + '\n')
    print(f'wrote {len(cases)} cases to {args.out}')


if __name__ == '__main__':
    main()
