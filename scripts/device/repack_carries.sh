#!/usr/bin/env bash
# Here (not on the GPU machine), after ../shared/device/prepare_sglang.sh: repack its .sg01..sg15
# folders (~61 MiB each) into .sgc01.. folders that fit one device call together with the working
# tree (the call's limit is 64 MiB for tree + carry; the tree alone is ~4 MiB, so a 61 MiB folder is
# refused: "the working tree is larger than 64 MiB"). Seen 2026-12-02: the refusals, and the machine
# going cold (30 s idle) while the folders were repacked by hand, cost one Triton install.
#   bash scripts/device/repack_carries.sh          prints the carry order: one `run` per folder, back to back,
#                                                  each `bash scripts/device/install_sglang.sh .sgcNN`
# The last folder holds LAST (install_sglang.sh installs everything on that call).
set -euo pipefail
cd "$(dirname "$0")/../.."
ls -d .sg[0-9][0-9] >/dev/null 2>&1 || { echo "no .sgNN folders: run ../shared/device/prepare_sglang.sh first" >&2; exit 1; }
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
python3 - "$tree" <<'EOF'
import os, shutil, sys
tree = int(sys.argv[1])
limit = 64 * 2**20 - tree - 2 * 2**20          # 2 MiB margin for untracked files
srcs = sorted(d for d in os.listdir('.') if len(d) == 5 and d.startswith('.sg') and d[3:].isdigit())
files = [(os.path.getsize(f'{d}/{f}'), f'{d}/{f}') for d in srcs for f in os.listdir(d) if '.whl' in f]
def halve(path):
    """Split a file larger than the limit in two, the first piece of ``limit`` bytes: a part keeps
    its name for it and the rest gets a 'b' suffix (``cat name.part*`` still joins them in order); a
    whole wheel becomes .part00 / .part01 (install_sglang.sh joins from .part00)."""
    data = open(path, 'rb').read()
    h = limit
    first, second = (path, path + 'b') if '.part' in path else (path + '.part00', path + '.part01')
    if first != path:
        os.remove(path)
    open(first, 'wb').write(data[:h])
    open(second, 'wb').write(data[h:])
    return [(h, first), (len(data) - h, second)]
while any(s > limit for s, _ in files):    # the tree has grown since the parts were cut
    files = [x for s, p in files for x in (halve(p) if s > limit else [(s, p)])]
bins = []
for s, p in sorted(files, reverse=True):
    for b in bins:
        if b[0] + s <= limit:
            b[0] += s; b[1].append(p); break
    else:
        bins.append([s, [p]])
with open('.git/info/exclude', 'a+') as ex:
    ex.seek(0); known = ex.read()
    for i in range(len(bins)):
        if f'/.sgc{i + 1:02d}/' not in known:
            ex.write(f'/.sgc{i + 1:02d}/\n')
for i, (s, ps) in enumerate(bins):
    d = f'.sgc{i + 1:02d}'
    os.makedirs(d, exist_ok=True)
    for p in ps:
        shutil.move(p, f'{d}/{os.path.basename(p)}')
    if i == len(bins) - 1:
        open(f'{d}/LAST', 'w').write(str(len(bins)))
    print(f'{d} {s / 2**20:.1f} MiB {len(ps)} files')
for d in srcs:
    shutil.rmtree(d)
print(f'{len(bins)} calls: run(carry=[".sgcNN"], command="bash scripts/device/install_sglang.sh .sgcNN") in order, '
      'back to back (the machine goes cold after 30 s idle and /tmp is lost)')
EOF
