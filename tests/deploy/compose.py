"""Read compose.yaml the way ``docker compose`` does, for tests that start its services
as plain processes (no Docker engine on the test machines)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
#: the override that makes the gpu profile (compose -f compose.yaml -f compose.gpu.yaml)
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
#: where services/Dockerfile puts the checkout (WORKDIR)
IMAGE_ROOT = "/app"

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``."""

    def sub(m: re.Match[str]) -> str:
        name, op, arg = m.group("name"), m.group("op"), m.group("arg") or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and not value:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    return _VAR.sub(sub, text.replace("$$", "\0")).replace("\0", "$")


def _resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_resolve(v, env) for v in node]
    if isinstance(node, dict):
        return {k: _resolve(v, env) for k, v in node.items()}
    return node


def _merge(base: Any, over: Any) -> Any:
    # compose's rule for -f files: mappings merge key by key, anything else is replaced
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in over.items()}}
    return over


def load(env: Mapping[str, str] | None = None, gpu: bool = False) -> dict[str, Any]:
    """compose.yaml (with compose.gpu.yaml over it when ``gpu``), YAML merge keys applied
    and variables interpolated."""
    raw = yaml.safe_load(COMPOSE.read_text())
    if gpu:
        raw = _merge(raw, yaml.safe_load(COMPOSE_GPU.read_text()))
    resolved: dict[str, Any] = _resolve(raw, env or {})
    return resolved


def service_env(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        return dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def host_argv(argv: list[str]) -> list[str]:
    """The service command with the image's checkout path mapped onto this checkout."""
    return [str(ROOT / a[len(IMAGE_ROOT) + 1 :]) if a.startswith(IMAGE_ROOT + "/") else a
            for a in argv]  # fmt: skip


def mounts(service: Mapping[str, Any], project: Path, volumes: Path) -> dict[str, Path]:
    """Where each container path of ``service`` lives on this machine: a bind mount's
    source relative to ``project`` (what ``./`` means beside compose.yaml), a named
    volume under ``volumes``."""
    out: dict[str, Path] = {}
    for spec in service.get("volumes") or []:
        source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            out[target] = (project / source).resolve()
        else:
            out[target] = volumes / source
    return out


def in_container(value: str, where: Mapping[str, Path]) -> str:
    """``value`` with a container path (``PYTHONPATH: /app/jobs``, a credentials file)
    put where its mount is here; a path no mount holds is left as it is."""
    for target in sorted(where, key=len, reverse=True):
        if value == target or value.startswith(target + "/"):
            return str(where[target]) + value[len(target) :]
    return value


def read_only(service: Mapping[str, Any]) -> set[str]:
    """The container paths ``service`` mounts read-only."""
    return {spec.split(":")[1] for spec in service.get("volumes") or []
            if spec.split(":")[2:] == ["ro"]}  # fmt: skip
