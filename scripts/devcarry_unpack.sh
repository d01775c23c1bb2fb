# Sourced by the scripts/gpu_*.sh scripts, from the repository root: unpacks .devcarry/bundle.tar.xz
# (built here by scripts/prepare_devcarry.sh) into D=/tmp/ck_devcarry and puts its libraries on
# LD_LIBRARY_PATH. Fresh each call: a warm GPU machine keeps /tmp between calls, and an older
# bundle's binaries must not run in a newer tree's call.
D=/tmp/ck_devcarry
rm -rf "$D" && mkdir -p "$D"
if ! tar -C "$D" -xJf .devcarry/bundle.tar.xz 2>/dev/null; then
  python3 -c "import tarfile,sys; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" .devcarry/bundle.tar.xz "$D" || exit 3
fi
export LD_LIBRARY_PATH=$D/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
