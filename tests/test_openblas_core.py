"""faiss-cpu's bundled OpenBLAS gets kernels the CPU has (dml_core/evaluation/openblas_core.py): the choice from the
flags, the user's own setting kept, the environment restored, and -- in a fresh process -- the core OpenBLAS reports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dml_core.evaluation import openblas_core as oc


def test_core_follows_the_flags():
    skylake_x = frozenset("fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl".split())
    assert oc.core_for_flags(skylake_x) == "SkylakeX"
    assert oc.core_for_flags(frozenset("avx avx2 fma avx512f".split())) == "Haswell"  # AVX-512 F alone is not enough
    assert oc.core_for_flags(frozenset("sse2 avx".split())) is None
    assert oc.core_for_flags(frozenset()) is None


def test_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert oc.cpu_flags(str(info)) == frozenset({"fpu", "avx2", "fma"})
    assert oc.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_set_only_around_the_import_and_never_over_the_users_value(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t: avx2 fma\n")
    monkeypatch.delenv(oc.VARIABLE, raising=False)
    monkeypatch.delitem(sys.modules, "faiss", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    with oc.for_faiss_import(str(info)) as core:
        assert core == "Haswell" and os.environ[oc.VARIABLE] == "Haswell"
    assert oc.VARIABLE not in os.environ  # later processes detect for themselves
    monkeypatch.setenv(oc.VARIABLE, "")  # empty: OpenBLAS detects, so it is chosen here too, and restored after
    with oc.for_faiss_import(str(info)) as core:
        assert core == "Haswell" and os.environ[oc.VARIABLE] == "Haswell"
    assert os.environ[oc.VARIABLE] == ""
    monkeypatch.setenv(oc.VARIABLE, "Zen")
    with oc.for_faiss_import(str(info)) as core:
        assert core is None and os.environ[oc.VARIABLE] == "Zen"
    assert os.environ[oc.VARIABLE] == "Zen"


def test_faiss_loads_the_chosen_kernels_in_a_fresh_process():
    want = oc.core_for_flags(oc.cpu_flags())
    if want is None or not sys.platform.startswith("linux"):
        pytest.skip("the CPU has neither AVX-512 nor AVX2+FMA: OpenBLAS's own detection stands")
    env = {k: v for k, v in os.environ.items() if k != oc.VARIABLE}
    env["OPENBLAS_VERBOSE"] = "2"  # OpenBLAS prints "Core: <name>" when it loads
    # numpy's own (newer) OpenBLAS loads first and prints its core too: faiss's is the one after the mark.
    code = (
        "import os, sys, numpy, torch; print('MARK', file=sys.stderr, flush=True); import dml_core.evaluation.metrics; "
        "print('left', os.environ.get('OPENBLAS_CORETYPE'), file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    after = out.stderr.split("MARK", 1)[1]
    cores = [line.split(":", 1)[1].strip() for line in after.splitlines() if line.startswith("Core:")]
    assert cores == [want], out.stderr[-2000:]
    assert "left None" in after
