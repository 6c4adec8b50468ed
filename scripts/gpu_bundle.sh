#!/usr/bin/env bash
# Builds .gpu/ (ignored by git) on a machine with the package index, for a lent host that
# has none: wheels for its Python, py-spy, this machine's redis-server and redis-cli with
# the libraries they link (wrappers in .gpu/bin), and the committed tree as a tarball.
#
#   scripts/gpu_bundle.sh [PYTHON_VERSION]     (default 3.12, the lent hosts' Python)
#
# On the host (the device's run carries .gpu), from a copy of the tree:
#   pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl .gpu/tools/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:/tmp/site/bin:$PATH
# then scripts/cpu_suite.sh (it installs the wheels itself) or scripts/gpu/suite.sh.
set -euo pipefail

py="${1:-3.12}"
g=.gpu
rm -rf "$g"
mkdir -p "$g/wheels" "$g/tools" "$g/bin" "$g/lib"
plat=(--only-binary=:all: --python-version "$py" --platform manylinux2014_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
python3 -m pip download -q "${plat[@]}" -d "$g/wheels" "redis>=8.0,<9" "hiredis>=3.0" \
    "msgspec>=0.19,<1" "cryptography>=42" "structlog>=24.1" "orjson>=3.9" "numpy>=1.26" \
    "tqdm>=4.66" "fakeredis>=2.41,<3" "zstandard>=0.22"
python3 -m pip download -q "${plat[@]}" --no-deps -d "$g/tools" py-spy

# Redis from this machine, with what it links but the C library itself (the host's is
# newer; an older one here would be the wrong half of a pair).
for tool in redis-server redis-cli; do
    src=$(command -v "$tool")
    cp "$src" "$g/lib/$tool.bin"
    ldd "$src" | awk '/=> \//{print $3}' | while read -r lib; do
        case "$(basename "$lib")" in
        libc.so.* | libm.so.* | ld-linux*) ;;
        *) [ -e "$g/lib/$(basename "$lib")" ] || cp "$lib" "$g/lib/" ;;
        esac
    done
    cat > "$g/bin/$tool" <<EOF
#!/usr/bin/env bash
here="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")/../lib" && pwd)"
LD_LIBRARY_PATH="\$here\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/$tool.bin" "\$@"
EOF
    chmod +x "$g/bin/$tool"
done
git archive HEAD -o "$g/head.tar"
du -sh "$g"
