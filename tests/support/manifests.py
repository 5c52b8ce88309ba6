"""Reading the Kubernetes manifests in ``deploy/k8s`` as ``kubectl kustomize`` builds them (no cluster needed)."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def _json_patch(doc: dict, op: dict) -> None:
    """Apply one RFC 6902 ``add``/``replace`` operation to ``doc`` in place (what these overlays use)."""
    assert op["op"] in ("add", "replace"), f"JSON patch op {op['op']!r}: teach tests/support/manifests.py"
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op["value"])
    if isinstance(node, list) and last == "-":
        node.append(value)
    elif isinstance(node, list):
        node.insert(int(last), value) if op["op"] == "add" else node.__setitem__(int(last), value)
    else:
        node[last] = value


def _delete(docs: list[dict], directory: Path, patch: dict) -> list[dict]:
    """``docs`` less the object that the inline ``$patch: delete`` patch ``patch`` names (exactly one)."""
    assert set(patch) == {"patch"}, f"{directory}: patch {patch} without a target: teach load_kustomization"
    body = yaml.safe_load(patch["patch"])
    assert body.get("$patch") == "delete" and set(body) == {"$patch", "apiVersion", "kind", "metadata"}, \
        f"{directory}: a strategic-merge patch other than one whole-object delete: teach load_kustomization"
    key = (body["apiVersion"], body["kind"], body["metadata"]["name"])
    hits = [d for d in docs if (d["apiVersion"], d["kind"], d["metadata"]["name"]) == key]
    assert len(hits) == 1, f"{directory}: a patch deletes {key}, which matches {len(hits)} objects, not one"
    return [d for d in docs if d is not hits[0]]


def load_kustomization(directory: Path) -> list[dict]:
    """The objects ``kubectl kustomize DIRECTORY`` builds, for the features these kustomizations use.

    Resources (files and directories) in order, patch files of JSON patches
    aimed at one kind/name, and inline strategic-merge ``$patch: delete``
    patches without a target (each deletes the one object of its apiVersion,
    kind and name); ``images`` only renames the image.

    Raises:
        AssertionError: a feature this reader does not know, or a patch target
            that is not exactly one object.
    """
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "resources", "patches", "images"}
    assert not unknown, f"{directory}/kustomization.yaml uses {sorted(unknown)}: teach load_kustomization"
    docs: list[dict] = []
    for resource in k.get("resources", []):
        path = directory / resource
        docs += load_kustomization(path) if path.is_dir() else [
            d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for patch in k.get("patches", []):
        if "target" not in patch:
            docs = _delete(docs, directory, patch)
            continue
        target = patch["target"]
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{directory}: patch {patch['path']} targets {len(hits)} objects, not one"
        for op in yaml.safe_load((directory / patch["path"]).read_text()):
            _json_patch(hits[0], op)
    return docs


def objects(directory: Path) -> dict[tuple[str, str], dict]:
    """``load_kustomization`` keyed by ``(kind, name)``."""
    return {(d["kind"], d["metadata"]["name"]): d for d in load_kustomization(directory)}


def the_container(workload: dict) -> dict:
    """The workload's only container (AssertionError: not exactly one)."""
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{workload['metadata']['name']}: expected one container"
    return containers[0]
