#!/usr/bin/env python3
"""Writes a container image, as a docker-archive tar that `ctr images import`
reads, from a root file system directory: one layer, owners and modes as they
are on disk, every time stamp the same (the same tree gives the same image).

    image.py --rootfs DIR --out FILE.tar --tag REF [--tag REF...]
             [--entrypoint JSON] [--cmd JSON] [--user UID:GID] [--env K=V...]
             [--expose 7946/udp...] [--workdir DIR]
             [--dockerfile FILE --builder-out DIR]
    image.py --builder-steps FILE

With --dockerfile, the image is the one FILE's last stage states: its
`COPY --from=builder [--chown=U:G] /out/SRC DST` lines copy DIR/SRC (what the
builder stage's steps made there) into the root file system (a source that
is not in DIR is left out: the previous sidecar's image has no operator),
and its USER, EXPOSE, ENTRYPOINT, CMD, ENV and WORKDIR are the image's
config. --builder-steps prints the commands of the builder stage's last RUN,
one per line (its `&&` chain): scripts/cluster runs the same steps. So the
Dockerfile is the one list of the image's steps, whichever builds it.

Used by scripts/cluster: no image is ever pulled on the test cluster.
"""
import argparse
import hashlib
import io
import json
import os
import re
import shlex
import shutil
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


def instructions(dockerfile):
    """The Dockerfile's instructions as (stage index, KEYWORD, text), its
    continuation lines joined, comments and heredoc bodies left out."""
    out, stage, pending, heredoc = [], -1, "", None
    with open(dockerfile) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if heredoc is not None:
                if line.strip() == heredoc:
                    heredoc = None
                continue
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text, pending = (pending + line).strip(), ""
            keyword, _, rest = text.partition(" ")
            keyword = keyword.upper()
            if keyword == "FROM":
                stage += 1
            m = re.search(r"<<-?'?\"?([A-Z]+)'?\"?\s*$", rest)
            if m:
                heredoc = m.group(1)
            out.append((stage, keyword, rest.strip()))
    return out


def builder_steps(dockerfile):
    """The commands of the builder stage's last RUN (the stage that writes
    /out), split at `&&`."""
    stages = instructions(dockerfile)
    last = max(s for s, _, _ in stages)
    runs = [rest for s, k, rest in stages if k == "RUN" and s < last and "/out/" in rest]
    if not runs:
        sys.exit(f"image.py: {dockerfile}: no RUN of the builder stage writes /out")
    return [step.strip() for step in runs[-1].split("&&")]


def from_dockerfile(dockerfile, rootfs, builder_out):
    """Copies what the last stage's COPY --from=builder lines name into
    rootfs; returns the last stage's config instructions."""
    stages = instructions(dockerfile)
    last = max(s for s, _, _ in stages)
    config = {}
    for stage, keyword, rest in stages:
        if stage != last:
            continue
        if keyword == "COPY":
            words = shlex.split(rest)
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if "--from=builder" not in flags or len(paths) != 2:
                sys.exit(f"image.py: {dockerfile}: COPY {rest!r}: expected --from=builder SRC DST")
            src, dst = paths
            if not src.startswith("/out/"):
                sys.exit(f"image.py: {dockerfile}: COPY {rest!r}: the builder's files are under /out")
            local = os.path.join(builder_out, src[len("/out/"):])
            if not os.path.exists(local):
                continue
            target = os.path.join(rootfs, dst.lstrip("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.isdir(local):
                shutil.copytree(local, target, dirs_exist_ok=True, symlinks=True)
            else:
                shutil.copy2(local, target)
            chown = [f.split("=", 1)[1] for f in flags if f.startswith("--chown=")]
            if chown:
                uid, gid = (int(x) for x in chown[0].split(":"))
                for dirpath, dirnames, filenames in os.walk(target):
                    for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                        os.lchown(name, uid, gid)
                os.lchown(target, uid, gid)
        elif keyword in ("USER", "WORKDIR"):
            config[keyword] = rest
        elif keyword in ("ENTRYPOINT", "CMD"):
            config[keyword] = json.loads(rest)
        elif keyword == "EXPOSE":
            config.setdefault(keyword, []).extend(rest.split())
        elif keyword == "ENV":
            key, _, value = rest.partition("=")
            config.setdefault(keyword, []).append(f"{key.strip()}={value.strip()}")
    return config


def main():
    if sys.argv[1:2] == ["--builder-steps"] and len(sys.argv) == 3:
        print("\n".join(builder_steps(sys.argv[2])))
        return
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
    p.add_argument("--dockerfile", default=None)
    p.add_argument("--builder-out", default=None)
    a = p.parse_args()
    if not os.path.isdir(a.rootfs):
        sys.exit(f"image.py: --rootfs {a.rootfs!r} is not a directory")
    if a.dockerfile:
        if not a.builder_out:
            sys.exit("image.py: --dockerfile needs --builder-out (the builder stage's /out)")
        stated = from_dockerfile(a.dockerfile, a.rootfs, a.builder_out)
        a.user = stated.get("USER", a.user)
        a.workdir = stated.get("WORKDIR", a.workdir)
        a.entrypoint = json.dumps(stated["ENTRYPOINT"]) if "ENTRYPOINT" in stated else a.entrypoint
        a.cmd = json.dumps(stated["CMD"]) if "CMD" in stated else a.cmd
        a.expose = stated.get("EXPOSE", []) + a.expose
        a.env = stated.get("ENV", []) + a.env

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
