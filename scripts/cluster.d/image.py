#!/usr/bin/env python3
"""Writes a container image, as a docker-archive tar that `ctr images import`
reads, from a root file system directory: one layer, owners and modes as they
are on disk, every time stamp the same (the same tree gives the same image).

    image.py --rootfs DIR --out FILE.tar --tag REF [--tag REF...]
             [--entrypoint JSON] [--cmd JSON] [--user UID:GID] [--env K=V...]
             [--expose 7946/udp...] [--workdir DIR]

Used by scripts/cluster: no image is ever pulled on the test cluster.
"""
import argparse
import hashlib
import io
import json
import os
import sys
import tarfile

EPOCH = 0


def layer_bytes(rootfs):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(rootfs):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                arc = os.path.relpath(full, rootfs)
                info = tar.gettarinfo(full, arcname=arc)
                info.mtime = EPOCH
                info.uname = info.gname = ""
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    return buf.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rootfs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tag", action="append", required=True)
    p.add_argument("--entrypoint", default=None)
    p.add_argument("--cmd", default=None)
    p.add_argument("--user", default="")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--expose", action="append", default=[])
    p.add_argument("--workdir", default="/")
    a = p.parse_args()
    if not os.path.isdir(a.rootfs):
        sys.exit(f"image.py: --rootfs {a.rootfs!r} is not a directory")

    layer = layer_bytes(a.rootfs)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    cfg = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"] + a.env, "WorkingDir": a.workdir}
    if a.user:
        cfg["User"] = a.user
    if a.entrypoint:
        cfg["Entrypoint"] = json.loads(a.entrypoint)
    if a.cmd:
        cfg["Cmd"] = json.loads(a.cmd)
    if a.expose:
        cfg["ExposedPorts"] = {port: {} for port in a.expose}
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": cfg,
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "scripts/cluster.d/image.py"}],
        },
        sort_keys=True,
    ).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    layer_name = diff_id[len("sha256:"):] + "/layer.tar"
    manifest = json.dumps([{"Config": config_name, "RepoTags": a.tag, "Layers": [layer_name]}]).encode()

    tmp = a.out + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as out:
        for name, data in ((layer_name, layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = EPOCH
            out.addfile(info, io.BytesIO(data))
    os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
