"""tools/bazel's plain errors, and the module list that Bazel and tools/build_ext.py read."""

import os
import pathlib
import stat
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import build_ext  # noqa: E402
from v4train.ops import OPS  # noqa: E402


def test_the_module_list_is_the_registry_s_cpp_ops():
    bzl = build_ext.read_bzl()
    assert set(bzl["V4_OPS"]) == {n for n, op in OPS.items() if op.has_cpp}, \
        "cc/ops.bzl's V4_OPS must list exactly the ops whose Op has has_cpp=True"
    modules = build_ext.read_modules()
    assert "v4_bridge_test" in modules
    for name, (folder, deps) in modules.items():
        bind, own = build_ext.sources(name)
        assert os.path.exists(bind), f"{name}: {bind} (paths follow the op name)"
        assert name in bzl["V4_TEST_MODULES"] or own, f"{name}: no cc/{folder}/{name.removeprefix('v4_')}.cc"
        assert set(deps) <= set(bzl["V4_OPS"]), f"{name} calls unknown ops {set(deps) - set(bzl['V4_OPS'])}"


def test_every_mutation_of_the_mutation_check_still_applies():
    """tools/mutants.py finds each bug's text exactly once: a source edited since leaves its
    mutation unable to apply (latent_backward_softmax_scale's did, from 3071b91 until found)."""
    import mutants

    for m in mutants.MUTATIONS:
        with open(os.path.join(ROOT, m.path)) as f:
            assert f.read().count(m.find) == 1, f"{m.name}: its text is not in {m.path} exactly once"


def test_the_plane_kernels_fragment_addresses_give_their_products():
    # The CUDA plane kernels' ldmatrix addresses, emulated on the CPU (the check fails a wrong address).
    import mma_fragments_check
    assert mma_fragments_check.main() == 0


def test_the_dqkwg_kernels_carve_and_tiles_hold():
    # dqkwg_planes_kernel's shared-memory phases and its products' tile dealing, emulated on the CPU
    # (it fails a region placed over a live one).
    import dqkwg_check
    assert dqkwg_check.main() == 0


def test_the_forward_plane_kernels_hand_offs_hold():
    # recurrence_planes' hand-offs (base and d_o token a step ahead) and output_planes' carve with its
    # early copies, emulated on the CPU (it fails the base a step late and q's rows over h's).
    import delta_rule_forward_check
    assert delta_rule_forward_check.main() == 0


def test_the_fp8_kernels_transposition_places_every_byte():
    # The experts' FP8 kernel's backward tile transposition, emulated on the CPU (it fails stores
    # without the swizzle).
    import fp8_transpose_check
    assert fp8_transpose_check.main() == 0


def test_the_fp8_registers_kernels_fragments_and_epilogue_hold():
    # fp8_registers_kernel's A fragments through TMA's 64-byte swizzle, its products' order, its
    # transposing epilogue and its carve, emulated on the CPU (it fails fragments whose rows +8 are the first 8).
    import fp8_registers_check
    assert fp8_registers_check.main() == 0


def test_ncu_phases_splits_a_kernel_at_its_barriers():
    import ncu_phases
    head = '"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"\n'
    rows = [("LDG.E R2, [R4]", 10, 100), ("BAR.SYNC.DEFER_BLOCKING 0x0", 0, 100),  # phase 1: 200 instr, 10 samples
            ("HMMA.16816.F32.BF16 R8, R12, R14, R8", 30, 300), ("BAR.SYNC.DEFER_BLOCKING 0x0", 0, 100),  # 400, 30
            ("@P0 BRA `(.L_x_2)", 20, 100), ("EXIT", 40, 300)]  # phase 3: 400, 60 (of 1,000 and 100)
    body = "".join(f'"0x{i:x}","{src}","{s}","{n}"\n' for i, (src, s, n) in enumerate(rows))
    kernel = '"Kernel Name","void ns::<unnamed>::k<int>(ns::Args)"\n' + head + body
    found = ncu_phases.kernels(kernel + kernel)  # printed twice, counted once
    assert [name for name, _ in found] == ["void ns::<unnamed>::k<int>(ns::Args)"]
    phases = ncu_phases.phases(found[0][1])
    assert [(p["first"], p["last"], p["instructions"], p["samples"]) for p in phases] == \
        [(0, 1, 20.0, 10.0), (2, 3, 40.0, 30.0), (4, 5, 40.0, 60.0)]
    assert phases[1]["landmarks"] == {"HMMA": 75.0}
    assert phases[2]["top"][0] == ("EXIT", 75.0)
    assert ncu_phases.opcode("@!P0 BRA `(.L_x_1)") == "BRA"
    assert "k<int>(Args): 0.0M instructions, 100 stall samples" in ncu_phases.report(kernel)


def test_a_mutation_that_does_not_build_is_said_so_not_counted_a_survivor(monkeypatch, capsys, tmp_path):
    """A typo in a mutation is no gap in the tests: the report says the compiler's last line, and
    the run fails (found by a kernel developer's QA pass: it printed SURVIVED)."""
    import mutants

    m = next(m for m in mutants.MUTATIONS if not m.cuda)
    builds = iter([None, RuntimeError("x.cc:3: error: expected ';'"), None])

    def build(*args, **kwargs):
        outcome = next(builds)
        if outcome:
            raise outcome

    source = tmp_path / m.path  # (main restores the mutated file: here, not in the sources)
    source.parent.mkdir(parents=True)
    source.write_text("original")
    monkeypatch.setattr(mutants, "ROOT", str(tmp_path))
    monkeypatch.setattr(mutants, "build", build)
    monkeypatch.setattr(mutants, "apply", lambda m: source.read_text())
    monkeypatch.setattr(mutants, "run_tests", lambda *args, **kwargs: (True, ""))
    monkeypatch.setattr(sys, "argv", ["mutants.py", f"--only={m.name}"])
    assert mutants.main() == 1
    out = capsys.readouterr().out
    assert f"| {m.name} | {m.what} | DID NOT BUILD: x.cc:3: error: expected ';' (" in out
    assert f"mutants: 0 of 1 caught; did not build (fix the mutation): {m.name}" in out


def test_a_mutants_copy_starts_from_the_objects_of_the_build_it_is_seeded_from(tmp_path):
    """mutants.py --cuda seeds the unmutated copy from the checkout's build/ext (and each mutated
    copy from that copy): an object keeps its time, so build_ext compiles none again whose source
    (copied with its time) is no newer, and an object named by its source's path is renamed for the
    copy's root; one of a source outside the root (nanobind's) keeps its name."""
    import mutants

    built, root = tmp_path / "a", tmp_path / "b"
    objdir = built / "build" / "ext" / "obj-cuda"
    objdir.mkdir(parents=True)
    prefix = lambda r: os.path.relpath(r, "/").replace("/", "_") + "_"
    ours, theirs = objdir / (prefix(built) + "cc_ops_x.cu.o"), objdir / "usr_nanobind_src_common.cpp.o"
    for obj in (ours, theirs):
        obj.write_text(obj.name)
        os.utime(obj, (1_000_000, 1_000_000))
    mutants.seed_objects(str(built / "build" / "ext"), str(built), str(root))
    seeded = pathlib.Path(mutants.out_dir(str(root))) / "obj-cuda"
    assert sorted(p.name for p in seeded.iterdir()) == sorted([prefix(root) + "cc_ops_x.cu.o", theirs.name])
    assert (seeded / (prefix(root) + "cc_ops_x.cu.o")).read_text() == ours.name
    assert all(p.stat().st_mtime == 1_000_000 for p in seeded.iterdir())


def test_every_cuda_mutation_names_the_module_built_for_it():
    """mutants.py --cuda builds, in each mutation's copy of the sources, only the module of the
    mutated kernel file (module_of: the file's name, as cc/ops.bzl names modules, or the mutation's
    `module` for a file of cc/common, which every module builds): a mutation in a file that no
    module built there compiles (a shared .cuh) would fail to build, on the GPU's time."""
    import mutants

    modules = build_ext.read_modules()
    for m in mutants.MUTATIONS:
        if m.cuda:
            name = mutants.module_of(m)
            assert name in modules, f"{m.name}: {m.path} is built into no module named {name}"
            if m.module:  # build_ext compiles every cc/common/*.cc and *.cu into each module
                assert os.path.dirname(m.path) == "cc/common" and m.path.endswith((".cc", ".cu")), m.name
                continue
            own = build_ext.sources(name, cuda=True)[1]
            assert os.path.join(build_ext.ROOT, m.path) in own, f"{m.name}: {name} does not build {m.path}"


def _tools_bazel(tmp_path, base_python):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "V4TRAIN_HOME": str(tmp_path / "home"),
           "V4TRAIN_BASE_PYTHON": base_python}
    return subprocess.run([os.path.join(ROOT, "tools", "bazel"), "version"], env=env,
                          capture_output=True, text=True, timeout=60)


def _fake_python(tmp_path, body):
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v bazel-4 || command -v bazel"],
                                   capture_output=True).returncode != 0, reason="needs Bazel installed")
@pytest.mark.parametrize(
    "make_python,message",
    [
        (lambda tmp: str(tmp / "missing"), "no Python interpreter"),
        (lambda tmp: _fake_python(tmp, 'case "$2" in *platform*) echo 3.8.10;; *) exit 1;; esac'),
         "is Python 3.8.10; v4train needs Python >= 3.10."),
        (lambda tmp: _fake_python(tmp, 'case "$2" in *torch*) exit 1;; *) exit 0;; esac'),
         "cannot import torch; point it at a Python that has torch."),
    ],
)
def test_tools_bazel_says_what_is_missing_in_one_line(tmp_path, make_python, message):
    result = _tools_bazel(tmp_path, make_python(tmp_path))
    assert result.returncode == 1
    assert message in result.stderr
    assert result.stderr.startswith("tools/bazel: ")
    assert not (tmp_path / "home").exists(), "nothing is created before the checks pass"


@pytest.mark.skipif(subprocess.run(["sh", "-c", "command -v bazel-4 || command -v bazel"],
                                   capture_output=True).returncode != 0, reason="needs Bazel installed")
def test_base_python_is_layered_under_the_environment(tmp_path):
    """V4TRAIN_BASE_PYTHON: the environment sees the base's torch and installs no torch of its own."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "V4TRAIN_HOME": str(tmp_path / "home"),
           "V4TRAIN_BASE_PYTHON": sys.executable, "BAZEL_REAL": "/bin/true"}  # stop where Bazel would start
    result = subprocess.run([os.path.join(ROOT, "tools", "bazel"), "version"], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    (env_dir,) = (tmp_path / "home").glob("env-*")
    python = env_dir / "bin" / "python"
    torch_file = subprocess.run([str(python), "-c", "import torch; print(torch.__file__)"], capture_output=True,
                                text=True, check=True).stdout.strip()
    import torch

    assert torch_file == torch.__file__, "the base Python's torch, not a second copy"
    assert not list(env_dir.glob("lib/python*/site-packages/torch")), "no torch installed in the layer"


def test_the_benchmark_runs_a_picked_case_once(capsys):
    """tools/benchmark.py --once (what a profiler attaches to) runs each picked case's forward and
    backward once and times nothing; --cases picks by index."""
    import benchmark

    benchmark.main(["--device", "cpu", "--dtype", "float32", "--ops", "v4_rms_norm", "--impl", "reference",
                    "--cases", "0", "--once"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| v4_rms_norm")]
    assert len(rows) == 1 and rows[0].endswith("| reference | once | once | once | - |"), rows
    benchmark.main(["--device", "cpu", "--dtype", "float32", "--ops", "v4_rms_norm", "--impl", "reference",
                    "--cases", "1", "--once"])  # v4_rms_norm has one case
    assert "| v4_rms_norm" not in capsys.readouterr().out


def test_gpu_check_packs_its_logs_into_one_file(tmp_path):
    """tools/gpu_check.sh with PACK=1 leaves OUT holding logs.tar.gz alone, with what the run wrote in it
    (the device tool brings back 8 files at most: a report left out was lost once)."""
    import tarfile

    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), STAGES="none", PACK="1")
    subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu_check.sh")], env=env, capture_output=True, check=True)
    assert sorted(os.listdir(out)) == ["logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "./env.txt" in tar.getnames()


def test_the_fla_peer_takes_the_ops_arguments_and_says_when_its_check_is_lifted(monkeypatch):
    """tools/benchmark.py's fla peer of v4_gated_delta_rule (on stand-in fla modules): None without fla;
    with it, fla's chunk_gated_delta_rule on a batch of one (q and k normalised in its kernel, g in
    float32, the packed batch's cu_seqlens), its output's one row returned; its refusal of this Triton
    (fla issue 640) lifted only when asked, the row then naming its gradients wrong."""
    import types

    import benchmark
    import torch

    monkeypatch.setitem(sys.modules, "fla", None)
    assert benchmark.fla_gated_delta_rule(False) is None
    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel):
        calls.append((q.shape, k.shape, g.dtype, beta.shape, cu_seqlens.tolist(), use_qk_l2norm_in_kernel))
        return v * 2, None

    chunk_o = types.SimpleNamespace(TRITON_ABOVE_3_7_1=False)
    modules = {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"),
               "fla.ops.common": types.ModuleType("fla.ops.common"), "fla.ops.common.chunk_o": chunk_o,
               "fla.ops.gated_delta_rule": types.SimpleNamespace(chunk_gated_delta_rule=chunk_gated_delta_rule)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    name, fn = benchmark.fla_gated_delta_rule(False)
    assert name == "fla" and chunk_o.TRITON_ABOVE_3_7_1 is False
    q, v = torch.zeros(5, 2, 4, dtype=torch.bfloat16), torch.ones(5, 4, 3, dtype=torch.bfloat16)
    g = torch.zeros(5, 4, dtype=torch.bfloat16)
    out = fn(q, q, v, g, g, torch.tensor([0, 2, 5]))
    assert out.shape == (5, 4, 3) and torch.equal(out, v * 2)
    assert calls == [((1, 5, 2, 4), (1, 5, 2, 4), torch.float32, (1, 5, 4), [0, 2, 5], True)]
    name, _ = benchmark.fla_gated_delta_rule(True)
    assert chunk_o.TRITON_ABOVE_3_7_1 is True and "gradients are wrong" in name
    name, _ = benchmark.fla_gated_delta_rule(True)  # the next case's row (--cases 1,2) says it too
    assert "gradients are wrong" in name


def test_the_profile_sums_the_device_time_of_each_kernel_once(monkeypatch, capsys):
    """tools/benchmark.py's --profile on CUDA (a stand-in profiler): its rows count a kernel under the
    function that launched it as well, so the last line sums the device events alone, once each."""
    import types

    import benchmark
    import torch

    CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    def span(us):
        return types.SimpleNamespace(elapsed_us=lambda: us)

    events = [types.SimpleNamespace(device_type=CUDA, time_range=span(300.0)),
              types.SimpleNamespace(device_type=CUDA, time_range=span(200.0)),
              types.SimpleNamespace(device_type=CPU, time_range=span(900.0))]
    rows = [types.SimpleNamespace(self_device_time_total=500.0, count=1, key="the function that launched both"),
            types.SimpleNamespace(self_device_time_total=300.0, count=1, key="kernel_a"),
            types.SimpleNamespace(self_device_time_total=200.0, count=1, key="kernel_b")]

    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return types.SimpleNamespace(key_averages=lambda: rows, events=lambda: events)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    benchmark.profile(lambda: None, "cuda")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["0.500", "ms", "50.0%"] and "kernel_a" in out[1]
    assert out[-1].split()[:2] == ["0.500", "ms"] and "all 2 kernels" in out[-1]


def test_the_split_check_rounds_the_stored_states_only_in_the_decay_s_gradient():
    """delta_rule_split_check's --stored: the state's decay and its gradient to the state as torch
    gives them; the gradient to the factor the float32 dot of the states in bf16 (each rounded
    once), and torch's own where none is rounded. --off's ScaledGradient: the value as given, its
    gradient scaled alone."""
    import torch

    import delta_rule_split_check as check

    gen = torch.Generator().manual_seed(0)
    state, grad = (torch.randn(2, 3, 8, 5, generator=gen) for _ in range(2))
    factor = torch.rand(2, 3, 1, 1, generator=gen)
    for stored in ((), ("h",), ("h", "d_state")):
        s, f = state.clone().requires_grad_(), factor.clone().requires_grad_()
        out = check.StoredDecay.apply(s, f, stored)
        out.backward(grad)
        assert torch.equal(out, state * factor) and torch.allclose(s.grad, grad * factor)
        h = state.bfloat16().float() if "h" in stored else state
        d = grad.bfloat16().float() if "d_state" in stored else grad
        expected = torch.einsum("bhij,bhij->bh", h.double(), d.double()).view(2, 3, 1, 1)
        assert torch.allclose(f.grad.double(), expected, rtol=1e-5), stored
    for off in (0.01, -0.1):
        s = state.clone().requires_grad_()
        out = check.ScaledGradient.apply(s, 1 + off)
        out.backward(grad)
        assert torch.equal(out, state) and torch.allclose(s.grad, grad * (1 + off)), off
    assert not torch.allclose(state.bfloat16().float(), state)  # (the rounding is there to see)


def test_the_split_check_stores_u_and_v_new_rounded_where_the_reference_names_them():
    """--stored u,v_new: the reference's store hook sees U and W once a document and v_new once a
    chunk, and Rounded gives the bf16 value with the gradient passed as it is; --stored dw (W's
    gradient) the value as it is with the gradient rounded."""
    import torch

    import delta_rule_split_check as check
    from v4train.reference.gated_delta_rule import v4_gated_delta_rule

    gen = torch.Generator().manual_seed(1)
    T, H, D = 130, 2, 8  # documents of 70 and 60 tokens: two chunks, then one
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    g, beta = -torch.rand(T, H, generator=gen), torch.rand(T, H, generator=gen)
    seen = []
    v4_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, 70, 130]), store=lambda x, name: seen.append(name) or x)
    assert seen == ["u", "w", "v_new", "v_new", "u", "w", "v_new"]
    x = torch.randn(4, 5, generator=gen, requires_grad=True)
    y = check.Rounded.apply(x)
    y.backward(torch.full_like(y, 3.0))
    assert torch.equal(y, x.detach().bfloat16().float()) and not torch.equal(y, x.detach())
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    x.grad = None
    y = check.Rounded.apply(x, False, True)  # (how Ops.store takes W under --stored dw)
    upstream = torch.randn(4, 5, generator=gen)
    y.backward(upstream)
    assert torch.equal(y, x.detach()) and torch.equal(x.grad, upstream.bfloat16().float())
    assert not torch.equal(x.grad, upstream)


def test_the_split_check_s_flashqla_formulation_is_the_rule_without_its_rounding(monkeypatch):
    """--flashqla: FlashQLA's formulation (Ar without the gate, Gamma * (Ar diag(beta)), v_new =
    Ag (V - e^G * (K S))) is the chunked rule exactly: in float64, with bf16 rounding taken out, its
    output and every gradient equal the reference's to float64 rounding, across documents of 1, 63,
    64, 65 and 130 tokens; with the rounding, they differ (its products are bf16)."""
    import torch

    import delta_rule_split_check as check
    from v4train.reference.gated_delta_rule import v4_gated_delta_rule

    gen = torch.Generator().manual_seed(2)
    lengths, H, D = [1, 63, 64, 65, 130], 2, 8
    T = sum(lengths)
    leaves = [torch.randn(T, H, D, generator=gen, dtype=torch.float64) for _ in range(3)]
    leaves += [-torch.rand(T, H, generator=gen, dtype=torch.float64) / 4, torch.rand(T, H, generator=gen, dtype=torch.float64)]
    cu = torch.tensor([0] + lengths).cumsum(0)
    upstream = torch.randn(T, H, D, generator=gen, dtype=torch.float64)

    def run(rule, **kw):
        xs = [x.clone().requires_grad_() for x in leaves]
        out = rule(*xs, cu, **kw)
        out.backward(upstream)
        return [out.detach()] + [x.grad for x in xs]

    want = run(v4_gated_delta_rule)
    rounded = run(check.flashqla_rule)
    monkeypatch.setattr(check, "bf16", lambda x: x)
    for exact_qk in (False, True):
        for name, got, ref in zip(["o", "q", "k", "v", "g", "beta"], run(check.flashqla_rule, exact_qk=exact_qk), want):
            assert ((got - ref).norm() / ref.norm()).item() < 1e-12, (name, exact_qk)
    assert ((rounded[0] - want[0]).norm() / want[0].norm()).item() > 1e-4
