#!/usr/bin/env bash
# Store I/O benchmark: the disk's sequential direct-I/O write and read bandwidth (dd, 4 MB blocks),
# then `cherenkov synth` of a full-geometry checkpoint (Qwen3.8-Flash-Next per-layer geometry, fewer
# layers), `cherenkov pack` of it and `cherenkov verify` of the store, each timed with the page cache
# emptied of its input first, and one summary line comparing them with the disk.
#
#   bash bench/io/pack_bench.sh [CHERENKOV_BINARY] [WORK_DIR]
#   env: LAYERS (16), DD_GB (4), THREADS (nproc), KEEP=1 keeps the files
#
# Disk budget: 16 layers + MTP at Q4 is 17 x 512 x 2.76 MB = 24.1 GB of experts (+ ~1.7 GB of dense
# tensors, embedding and head at the full 248,320 vocabulary) for the source and as much again for the
# store: about 52 GB, which fits a 64 GB disk only when it is nearly empty (the source must stay until
# pack has read it). The script measures what is free and lowers LAYERS until source + store fit with
# a 5% margin; the summary line says how many layers ran.
set -euo pipefail
bin=${1:-build/cherenkov}
work=${2:-/tmp/ck_pack_bench}
layers=${LAYERS:-16}
dd_gb=${DD_GB:-4}
threads=${THREADS:-$(nproc)}
bin=$(readlink -f "$bin")
mkdir -p "$work"
cleanup() { [ "${KEEP:-0}" = 1 ] || rm -rf "$work/src" "$work/store" "$work/dd.bin"; }
trap cleanup EXIT

now() { date +%s.%N; }
rate() { python3 -c "print(f'{$1/1e9/($3-$2):.2f}')"; }   # rate BYTES T0 T1 -> GB/s
size_of() { du -sb "$1" | cut -f1; }
# Drop a directory's files from the page cache without root (GNU dd: nocache with count=0 drops the
# whole file), so that a timed read comes from the disk, not from RAM.
evict() { for f in "$1"/*; do [ -f "$f" ] && dd if="$f" iflag=nocache count=0 status=none of=/dev/null || true; done; }

record=2764800                      # bytes per Q4 expert record (3 x 640 x 2560 / 2 + bf16 scales/biases)
per_layer=$((512 * record + 50000000))  # + a layer's dense tensors (GDN ~45 MB, QSA ~40 MB at Q4)
fixed=1000000000                    # embedding + head (248320 x 2560 at Q4, 0.72 GB), MTP dense, PLE + n-gram table
need() { echo $(( 2 * ( ($1 + 1) * per_layer + fixed ) )); }   # source + store, both on this disk
free=$(df -B1 --output=avail "$work" | tail -1)
budget=$(( free * 95 / 100 ))       # the dd file is deleted before synth starts
if [ $(( dd_gb * 1073741824 )) -gt "$budget" ]; then dd_gb=1; fi
requested=$layers
while [ "$layers" -gt 2 ] && [ "$(need "$layers")" -gt "$budget" ]; do layers=$((layers - 1)); done
if [ "$(need "$layers")" -gt "$budget" ]; then
  echo "pack_bench: not enough disk in $work: $((free / 1000000000)) GB free, need $(( $(need 2) / 1000000000 )) GB for 2 layers" >&2
  exit 1
fi
[ "$layers" = "$requested" ] || echo "pack_bench: $((free / 1000000000)) GB free: running $layers layers instead of $requested" >&2
echo "pack_bench: $(nproc) CPUs, $((free / 1000000000)) GB free in $work, $layers layers + MTP, $threads threads" >&2

# 1. The disk alone: sequential direct I/O, 4 MB blocks.
count=$((dd_gb * 256))
t0=$(now); dd if=/dev/zero of="$work/dd.bin" bs=4M count=$count oflag=direct conv=fsync status=none; t1=$(now)
disk_w=$(rate $((count * 4194304)) "$t0" "$t1")
t0=$(now); dd if="$work/dd.bin" of=/dev/null bs=4M iflag=direct status=none; t1=$(now)
disk_r=$(rate $((count * 4194304)) "$t0" "$t1")
rm -f "$work/dd.bin"
echo "pack_bench: disk: write $disk_w GB/s, read $disk_r GB/s (dd, 4 MB direct, $dd_gb GiB)" >&2

# 2. synth (writes with fdatasync per shard).
rm -rf "$work/src" "$work/store"
t0=$(now); "$bin" synth --layers "$layers" --out "$work/src" --threads "$threads" >&2; t1=$(now)
src_bytes=$(size_of "$work/src")
synth_r=$(rate "$src_bytes" "$t0" "$t1")

# 3. pack, reading the source from disk.
sync; evict "$work/src"
t0=$(now); "$bin" pack "$work/src" --out "$work/store" --threads "$threads" >&2; t1=$(now)
store_bytes=$(size_of "$work/store")
pack_r=$(rate "$store_bytes" "$t0" "$t1")
pack_s=$(python3 -c "print(f'{$t1-$t0:.1f}')")

# 4. verify, reading the store from disk (every checksum).
sync; evict "$work/store"
t0=$(now); "$bin" verify "$work/store" --threads "$threads" >&2; t1=$(now)
verify_r=$(rate "$store_bytes" "$t0" "$t1")

# Pack reads and writes the same disk: with reads and writes not overlapping, its ceiling is
# 1 / (1/read + 1/write); overlapped perfectly, the slower of the two.
bound=$(python3 -c "r,w=$disk_r,$disk_w; print(f'{1/(1/r+1/w):.2f}')")
echo "pack_bench: layers=$layers src=$(python3 -c "print(f'{$src_bytes/1e9:.1f}')")GB store=$(python3 -c "print(f'{$store_bytes/1e9:.1f}')")GB" \
     "disk_write=${disk_w}GB/s disk_read=${disk_r}GB/s synth=${synth_r}GB/s pack=${pack_r}GB/s (${pack_s}s;" \
     "$(python3 -c "print(f'{$pack_r/$disk_w:.2f}')")x disk write, $(python3 -c "print(f'{$pack_r/$bound:.2f}')")x the serial read+write bound ${bound}GB/s)" \
     "verify=${verify_r}GB/s ($(python3 -c "print(f'{$verify_r/$disk_r:.2f}')")x disk read)"
