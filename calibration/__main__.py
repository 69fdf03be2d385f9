"""``python -m calibration <command>``: build, publish and roll back frozen table artifacts.

    python -m calibration pask --model PATH --out DIR [--publish]     # calibrate (Ray tasks)
    python -m calibration compilerkv --model PATH --out DIR           # compile CompilerKV tables
    python -m calibration pask --model PATH --out DIR --data FILE     # ... on your data (calibration/data.py)
    python -m calibration publish --kind pask --artifact DIR [--version V] [--store DIR]
    python -m calibration versions --kind pask
    python -m calibration rollback --kind pask --version V

``publish`` / ``versions`` / ``rollback`` talk to the cluster's table registry
(``cluster.control``): run them where ``ray.init(address="auto")`` reaches the cluster, or under
``ray job submit``.
"""

import argparse
import json
import sys


def _registry_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m calibration {argv[0]}")
    ap.add_argument("--kind", required=True, choices=("pask", "compilerkv"))
    ap.add_argument("--address", default="auto", help="Ray cluster address")
    ap.add_argument("--store", help="table store directory (used when the registry is first created)")
    if argv[0] == "publish":
        ap.add_argument("--artifact", required=True, help="artifact folder to publish")
        ap.add_argument("--version", help="version name (default: a timestamp)")
    if argv[0] == "rollback":
        ap.add_argument("--version", required=True)
    args = ap.parse_args(argv[1:])
    import ray

    from calibration.artifacts import ArtifactError
    from cluster.control import get_registry, publish_artifact
    try:
        ray.init(address=args.address, namespace="structkv", log_to_driver=False)
    except ConnectionError as e:
        print(f"error: no Ray cluster at {args.address!r} ({e}); start one with `ray start --head` or "
              f"`serve run serve_config.yaml`", file=sys.stderr)
        return 2
    try:
        if argv[0] == "publish":
            version = publish_artifact(args.artifact, args.kind, args.store, args.version)
            print(f"published {args.kind} table {version}")
        elif argv[0] == "rollback":
            cur = ray.get(get_registry(args.store).rollback.remote(args.kind, args.version))
            print(f"{args.kind} table is now {cur['version']} ({cur['path']})")
        else:
            print(json.dumps(ray.get(get_registry(args.store).list_versions.remote(args.kind)), indent=1))
    except (ArtifactError, ValueError, ray.exceptions.RayTaskError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    builders = {"pask": "calibration.pask", "compilerkv": "calibration.compilerkv"}
    if argv and argv[0] in builders:
        import importlib
        return importlib.import_module(builders[argv[0]]).main(argv[1:])
    if argv and argv[0] in ("publish", "versions", "rollback"):
        return _registry_command(argv)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
