"""The ``runtime_env`` of a sweep config: how a user's own code reaches every Ray process (:class:`RuntimeEnvSpec`),
credentials kept out."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from pipelines.config.errors import FieldError
from pipelines.config.fields import Path_
from pipelines.config.strict import StrictModel
from pipelines.config.uris import redact_uri, shown

__all__ = ["RuntimeEnvSpec"]

#: Environment variables that hold credentials: never in a runtime_env (Ray logs runtime_envs in plain text).
_SECRET_ENV = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY)", re.I)


def _virtualenv_installed() -> bool:
    """Whether Ray can build a ``runtime_env.pip`` environment here (it needs the virtualenv package)."""
    return importlib.util.find_spec("virtualenv") is not None


class RuntimeEnvSpec(StrictModel):
    """Ray's ``runtime_env`` for every process of the sweep (trial drivers, warm fold workers, Ray Train workers), on
    the embedded local Ray and on a cluster: how a user's own loss, trunk or dataset code reaches them.  The driver
    imports the same code (``py_modules`` and ``working_dir`` are put on its ``sys.path``).  Credentials never travel
    here (Ray logs runtime_envs in plain text): use the cluster's own credential chain."""

    py_modules: list[Path_] = Field(default_factory=list, max_length=100)
    """Local package folders (or .whl / .zip files) shipped to every worker and importable there."""
    working_dir: Path_ | None = None
    """A local folder uploaded to every worker and made its working directory (importable, too)."""
    pip: list[str] = Field(default_factory=list, max_length=200)
    """Installable distributions (pip requirement strings) installed in every worker's environment."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """Further environment variables for every worker (no credentials)."""
    excludes: list[str] = Field(default_factory=list, max_length=200)
    """Files of working_dir / py_modules not to upload (gitignore-style patterns)."""

    @field_validator("py_modules")
    @classmethod
    def _modules(cls, v: list[str]) -> list[str]:
        out = []
        for i, p in enumerate(v):
            path = Path(p).expanduser()
            if not path.exists():
                raise FieldError(f"[{i}]", f"{shown(p)} does not exist (a local package folder or .whl/.zip file)")
            out.append(str(path.resolve()))
        return out

    @field_validator("working_dir")
    @classmethod
    def _working_dir(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = Path(v).expanduser()
        if not path.is_dir():
            raise ValueError(f"{shown(v)} is not a folder")
        return str(path.resolve())

    @field_validator("pip")
    @classmethod
    def _pip(cls, v: list[str]) -> list[str]:
        if v and not _virtualenv_installed():
            raise ValueError(
                "Ray installs runtime_env pip packages into a virtualenv, and the virtualenv package is not "
                "installed: pip install virtualenv (on every node), or install the packages on every node yourself "
                "and leave runtime_env.pip out"
            )
        return v

    @field_validator("env_vars")
    @classmethod
    def _no_credentials(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise FieldError(f".{k}", "is not an environment variable name")
            if _SECRET_ENV.search(k):
                raise FieldError(
                    f".{k}",
                    "looks like a credential; credentials never travel in a runtime_env (Ray "
                    "logs it in plain text): give the workers their own credentials",
                )
            if redact_uri(v[k]) != v[k]:  # a password in a URI, a ?token= / ?api_key= query parameter
                raise FieldError(
                    f".{k}",
                    "its value holds a credential (a password in a URI or a secret query parameter); credentials "
                    "never travel in a runtime_env (Ray logs it, the sweep writes its config to disk and MLflow): "
                    "give the workers their own (their environment, instance role or AWS shared credentials file)",
                )
        return v

    def ray_runtime_env(self) -> dict[str, Any]:
        """The ``runtime_env`` mapping for Ray (empty keys left out)."""
        out: dict[str, Any] = {}
        if self.py_modules:
            out["py_modules"] = list(self.py_modules)
        if self.working_dir:
            out["working_dir"] = self.working_dir
        if self.pip:
            out["pip"] = list(self.pip)
        if self.env_vars:
            out["env_vars"] = dict(self.env_vars)
        if self.excludes:
            out["excludes"] = list(self.excludes)
        return out

    def driver_paths(self) -> list[str]:
        """What the driver puts on ``sys.path`` so that it imports the code the workers get: each py_module's parent
        folder (a package folder is imported by its name), each .whl/.zip itself, and working_dir."""
        paths = []
        for p in self.py_modules:
            path = Path(p)
            paths.append(str(path if path.is_file() else path.parent))
        if self.working_dir:
            paths.append(self.working_dir)
        return paths

    def activate_on_driver(self) -> None:
        """Make the user's code importable in this process (idempotent)."""
        for p in reversed(self.driver_paths()):
            if p not in sys.path:
                sys.path.insert(0, p)
