"""Launch scripts under a fake slurm: ``sbatch``/``srun``/``scontrol``/``torchrun``/``curl`` on PATH
are small bash scripts that record their argv and environment; we assert the commands the
scripts build (node ranks, rendezvous, SGLang servers, engine URLs) and that a bad config stops
the launch before any process starts. The pre-flight config check runs for real."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"

_RECORD = """#!/usr/bin/env bash
"$FAKE_PYTHON" - "$(basename "$0")" "$@" <<'PY'
import json, os, sys
keep = ("SLURM_", "MASTER_", "NNODES", "NPROC_PER_NODE", "OMP_NUM_THREADS", "EARL_", "SGLANG_API",
        "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
env = {k: v for k, v in os.environ.items() if k.startswith(keep)}
with open(os.path.join(os.environ["FAKE_LOG"]), "a") as f:
    f.write(json.dumps({"tool": sys.argv[1], "argv": sys.argv[2:], "env": env}) + "\\n")
PY
"""

FAKES = {
    "torchrun": _RECORD + 'exit "${FAKE_TORCHRUN_RC:-0}"\n',
    "curl": _RECORD + "exit 0\n",
    "scontrol": _RECORD
    + r"""[[ "$1 $2" == "show hostnames" ]] || exit 1
if [[ $3 =~ ^(.*)\[([0-9]+)-([0-9]+)\]$ ]]; then
    prefix=${BASH_REMATCH[1]}; first=${BASH_REMATCH[2]}; last=${BASH_REMATCH[3]}
    for (( i = 10#$first; i <= 10#$last; i++ )); do printf "%s%0${#first}d\n" "$prefix" "$i"; done
else
    tr ',' '\n' <<< "$3"
fi
""",
    # srun: record; run a `bash ...` command once per task with the task's SLURM_PROCID/NODEID
    # (the per-node torchrun launcher); other commands (SGLang servers) are only recorded.
    "srun": _RECORD
    + r"""ntasks=1
while [[ $# -gt 0 && $1 == -* ]]; do
    [[ $1 == --ntasks=* ]] && ntasks=${1#--ntasks=}
    shift
done
[[ $1 == bash ]] || exit 0
for (( t = 0; t < ntasks; t++ )); do
    SLURM_PROCID=$t SLURM_NODEID=$t SLURM_STEP_NUM_TASKS=$ntasks "$@" || exit $?
done
""",
    # sbatch: read --nodes from the command line or the #SBATCH header, set the SLURM_* a job
    # sees, run the script in the foreground.
    "sbatch": _RECORD
    + r"""nodes=""
while [[ $1 == -* ]]; do
    case $1 in --nodes=*) nodes=${1#--nodes=} ;; esac
    shift
done
script=$1; shift
[[ -n $nodes ]] || nodes=$(sed -n 's/^#SBATCH --nodes=\([0-9]*\)/\1/p' "$script")
export SLURM_JOB_ID=4242 SLURM_NNODES=$nodes SLURM_SUBMIT_DIR=$PWD
export SLURM_JOB_NODELIST="node[01-$(printf %02d "$nodes")]"
exec bash "$script" "$@"
""",
}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in FAKES.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.jsonl"

    def run(*argv: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
        full_env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "MASTER_", "OMP_", "GLOO_SOCKET", "NCCL_SOCKET"))
            and k != "SOCKET_IFNAME"
        }
        full_env.update(
            PATH=f"{bin_dir}{os.pathsep}{full_env['PATH']}",
            FAKE_LOG=str(log),
            FAKE_PYTHON=sys.executable,
            PYTHON=sys.executable,
            **env,
        )
        log.write_text("")
        proc = subprocess.run(
            argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120
        )
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        return proc, calls

    return run


def _calls(calls, tool):
    return [c for c in calls if c["tool"] == tool]


def test_local_launcher_runs_torchrun_standalone(fake_slurm):
    proc, calls = fake_slurm(
        "bash", "scripts/train_local.sh", "configs/demo_cpu.yaml", "steps=3", "train.lr=1e-4"
    )
    assert proc.returncode == 0, proc.stderr
    assert "config ok: demo_cpu on 2 ranks" in proc.stdout
    (torchrun,) = _calls(calls, "torchrun")
    assert torchrun["argv"] == [
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "-m",
        "megatron_earl.cli.train",
        "--config",
        "configs/demo_cpu.yaml",
        "steps=3",
        "train.lr=1e-4",
    ]
    assert int(torchrun["env"]["OMP_NUM_THREADS"]) >= 1


def test_local_launcher_stops_on_a_bad_config_before_starting(fake_slurm):
    proc, calls = fake_slurm("bash", "scripts/train_local.sh", "configs/demo_cpu.yaml", NPROC="3")
    assert proc.returncode == 2
    assert "configuration cannot run on 3 ranks" in proc.stderr
    assert "nearest valid" in proc.stderr
    assert not _calls(calls, "torchrun")
    proc, calls = fake_slurm("bash", "scripts/train_local.sh", "configs/missing.yaml")
    assert proc.returncode == 2 and "'configs/missing.yaml' does not exist" in proc.stderr


def test_colocated_multi_node_rendezvous(fake_slurm):
    proc, calls = fake_slurm(
        "sbatch",
        "--nodes=2",
        "scripts/slurm_colocated.sbatch",
        "configs/demo_cpu.yaml",
        "steps=4",
        GPUS_PER_NODE="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "config ok: demo_cpu on 2 ranks" in proc.stdout
    assert _calls(calls, "scontrol")[0]["argv"] == ["show", "hostnames", "node[01-02]"]
    (srun,) = _calls(calls, "srun")
    assert srun["argv"][:4] == [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    assert srun["argv"][4:6] == ["bash", f"{ROOT}/scripts/torchrun_node.sh"]
    runs = _calls(calls, "torchrun")
    assert [r["env"]["SLURM_PROCID"] for r in runs] == ["0", "1"]
    for node_rank, run in enumerate(runs):
        assert run["argv"] == [
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node_rank}",
            "--master-addr=node01",
            "--master-port=24242",  # 20000 + job id 4242 % 20000
            "-m",
            "megatron_earl.cli.train",
            "--config",
            "configs/demo_cpu.yaml",
            "steps=4",
        ]


@pytest.mark.parametrize(
    ("env", "gloo", "nccl"),
    [
        ({"SOCKET_IFNAME": "ib0"}, "ib0", "ib0"),
        ({"SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib1"}, "ib0", "ib1"),
        ({}, None, None),
    ],
)
def test_multi_node_socket_interface_reaches_every_nodes_torchrun(fake_slurm, env, gloo, nccl):
    proc, calls = fake_slurm(
        "sbatch", "--nodes=2", "scripts/slurm_colocated.sbatch", "configs/demo_cpu.yaml",
        GPUS_PER_NODE="1", **env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = _calls(calls, "torchrun")
    assert len(runs) == 2
    for run in runs:
        assert run["env"].get("GLOO_SOCKET_IFNAME") == gloo
        assert run["env"].get("NCCL_SOCKET_IFNAME") == nccl


def test_colocated_one_node_sglang_engine(fake_slurm):
    proc, calls = fake_slurm(
        "sbatch",
        "scripts/slurm_colocated.sbatch",
        "configs/qwen2.5-7b_grpo.yaml",
        ENGINE="sglang",
        EARL_SKIP_CHECK="1",
        MASTER_PORT="29500",
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 node(s) x 8 = 8 ranks" in proc.stdout
    (run,) = _calls(calls, "torchrun")
    assert run["argv"][:5] == [
        "--nnodes=1",
        "--nproc-per-node=8",
        "--node-rank=0",
        "--master-addr=node01",
        "--master-port=29500",
    ]
    assert run["argv"][-1] == "rollout.engine=sglang"


def test_colocated_bad_layout_stops_before_srun(fake_slurm):
    proc, calls = fake_slurm(
        "sbatch", "scripts/slurm_colocated.sbatch", "configs/demo_cpu.yaml", "layouts.train=tp3"
    )
    assert proc.returncode == 2
    assert "cannot run on 8 ranks" in proc.stderr and "layouts.train" in proc.stderr
    assert not _calls(calls, "srun") and not _calls(calls, "torchrun")


def test_disaggregated_servers_then_trainer(fake_slurm):
    proc, calls = fake_slurm(
        "sbatch",
        "--nodes=3",
        "scripts/slurm_disaggregated.sbatch",
        "configs/demo_cpu_switching.yaml",  # fixed layouts: SGLang engines take no selected one
        "layouts.rollout=dp4",
        "layouts.experience=tp2dp2",
        "layouts.train=tp2dp2",
        SGLANG_MODEL_PATH="/models/qwen",
        SGLANG_SERVERS_PER_NODE="2",
        GPUS_PER_NODE="2",
        SGLANG_TP="1",
        SGLANG_ARGS="--mem-fraction-static 0.8",
    )
    assert proc.returncode == 0, proc.stderr
    assert "config ok: demo_cpu_switching on 4 ranks" in proc.stdout  # trainer: 2 nodes x 2 GPUs
    servers = [c for c in _calls(calls, "srun") if "sglang.launch_server" in c["argv"]]
    servers.sort(key=lambda c: c["argv"][c["argv"].index("--port") + 1])  # started with &
    assert len(servers) == 2
    key = servers[0]["argv"][servers[0]["argv"].index("--api-key") + 1]
    assert len(key) == 48 and key not in proc.stdout + proc.stderr  # generated, never printed
    for i, server in enumerate(servers):
        argv = server["argv"]
        assert argv[:4] == ["--nodes=1", "--ntasks=1", "--nodelist=node01", "--overlap"]
        cmd = argv[argv.index(sys.executable) :]
        assert cmd == [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            "/models/qwen",
            "--host",
            "0.0.0.0",
            "--port",
            str(30000 + i),
            "--tp-size",
            "1",
            "--base-gpu-id",
            str(i),
            "--api-key",
            key,
            "--mem-fraction-static",
            "0.8",
        ]
    urls = ["http://node01:30000", "http://node01:30001"]
    router_url = "http://node02:30100"  # on the trainer's first node
    health = [c["argv"][-1] for c in _calls(calls, "curl")]
    assert health == [f"{u}/health" for u in [*urls, router_url]]
    (router,) = [c for c in _calls(calls, "srun") if "sglang_router.launch_router" in c["argv"]]
    argv = router["argv"]
    assert "--nodelist=node02" in argv
    cmd = argv[argv.index(sys.executable) :]
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--host")] == urls
    assert cmd[cmd.index("--policy") + 1] == "cache_aware" and cmd[-2:] == ["--api-key", key]
    (trainer,) = [c for c in _calls(calls, "srun") if "bash" in c["argv"]]
    assert "--nodelist=node02,node03" in trainer["argv"] and "--ntasks=2" in trainer["argv"]
    runs = _calls(calls, "torchrun")
    assert len(runs) == 2
    for node_rank, run in enumerate(runs):
        argv = run["argv"]
        assert argv[:5] == [
            "--nnodes=2",
            "--nproc-per-node=2",
            f"--node-rank={node_rank}",
            "--master-addr=node02",
            "--master-port=24242",
        ]
        assert argv[-4:] == [
            "layouts.train=tp2dp2",
            "rollout.engine=sglang",
            f"rollout.engine_urls=[{','.join(urls)}]",
            f"rollout.sglang.router_url={router_url}",
        ]
        assert run["env"]["SGLANG_API_KEY"] == key


def test_disaggregated_reward_service_on_its_own_node(fake_slurm):
    """REWARD_NODES=1: node01 serves SGLang, node02 runs the reward service (before the trainer
    starts, health-checked), node03-04 train with reward.service_url and reward.fns set."""
    proc, calls = fake_slurm(
        "sbatch",
        "--nodes=4",
        "scripts/slurm_disaggregated.sbatch",
        "configs/demo_cpu_switching.yaml",
        "layouts.rollout=dp4",
        "layouts.experience=tp2dp2",
        "layouts.train=tp2dp2",
        "rollout.mode=async",
        SGLANG_MODEL_PATH="/models/qwen",
        GPUS_PER_NODE="2",
        SGLANG_TP="2",
        SGLANG_ROUTER="0",
        REWARD_NODES="1",
        REWARD_FNS="exact=exact_match,judge=my_pkg.rewards:judge",
    )
    assert proc.returncode == 0, proc.stderr
    (service,) = [c for c in _calls(calls, "srun") if "megatron_earl.rewards.service" in c["argv"]]
    argv = service["argv"]
    assert "--nodelist=node02" in argv
    cmd = argv[argv.index(sys.executable) :]
    assert cmd[cmd.index("--port") + 1] == "30200"
    assert cmd[cmd.index("--port") + 2 :] == [
        "--fn", "exact=exact_match", "--fn", "judge=my_pkg.rewards:judge"
    ]  # fmt: skip
    assert [c["argv"][-1] for c in _calls(calls, "curl")][-1] == "http://node02:30200/health"
    (trainer,) = [c for c in _calls(calls, "srun") if "bash" in c["argv"]]
    assert "--nodelist=node03,node04" in trainer["argv"]
    for run in _calls(calls, "torchrun"):
        assert run["argv"][-2:] == [
            "reward.service_url=http://node02:30200",
            "reward.fns=[exact,judge]",
        ]
        assert "rollout.mode=async" in run["argv"]


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({}, "set SGLANG_MODEL_PATH"),
        ({"SGLANG_MODEL_PATH": "/m", "SGLANG_NODES": "2"}, "no node left for the trainer"),
        ({"SGLANG_MODEL_PATH": "/m", "REWARD_NODES": "1"}, "REWARD_NODES=1 needs REWARD_FNS"),
        ({"SGLANG_MODEL_PATH": "/m", "REWARD_NODES": "x"}, "REWARD_NODES='x' is not a number"),
        ({"SGLANG_MODEL_PATH": "/m", "SGLANG_SERVERS_PER_NODE": "3"}, "3 servers x tp 4 > 8 GPUs"),
    ],
)
def test_disaggregated_bad_settings(fake_slurm, env, fragment):
    if "SGLANG_SERVERS_PER_NODE" in env:
        env = {**env, "SGLANG_TP": "4"}
    proc, calls = fake_slurm(
        "sbatch", "scripts/slurm_disaggregated.sbatch", "configs/demo_cpu_switching.yaml", **env
    )
    assert proc.returncode != 0
    assert fragment in proc.stderr
    assert not _calls(calls, "srun")


def test_scripts_are_executable_bash():
    for name in ("train_local.sh", "torchrun_node.sh", "slurm_colocated.sbatch", "gpu_smoke.sh"):
        path = SCRIPTS / name
        assert os.access(path, os.X_OK), name
        assert path.read_text().startswith("#!/usr/bin/env bash\n"), name
        subprocess.run(["bash", "-n", str(path)], check=True)
    subprocess.run(["bash", "-n", str(SCRIPTS / "slurm_disaggregated.sbatch")], check=True)
    if shutil.which("shellcheck"):  # lint when available (not required in CI)
        names = ("train_local.sh", "torchrun_node.sh", "slurm_colocated.sbatch", "gpu_smoke.sh")
        paths = [str(SCRIPTS / n) for n in (*names, "slurm_disaggregated.sbatch")]
        subprocess.run(["shellcheck", "-s", "bash", *paths], check=True)


_FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
[[ "$1" == --list-gpus ]] || exit 0
for (( i = 0; i < ${FAKE_GPUS:-0}; i++ )); do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done
"""
_FAKE_PYTHON = """#!/usr/bin/env bash
"$FAKE_PYTHON" -c 'import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "python", "argv": sys.argv[1:]}) + "\\n")' "$@"
[[ "$1" == -m && "$2" == pytest ]] && exit "${FAKE_PYTEST_RC:-0}"
exit 0
"""


def _gpu_smoke(tmp_path, *args: str, smi: bool = True, **env: str):
    """scripts/gpu_smoke.sh with a fake nvidia-smi (FAKE_GPUS devices) and a recording python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {"python": _FAKE_PYTHON, **({"nvidia-smi": _FAKE_NVIDIA_SMI} if smi else {})}
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.write_text("")
    # without smi: drop every PATH entry holding a real nvidia-smi
    dirs = [
        d for d in os.environ["PATH"].split(os.pathsep) if smi or not Path(d, "nvidia-smi").exists()
    ]
    full_env = {k: v for k, v in os.environ.items() if k not in ("NGPUS", "EARL_SKIP_INSTALL")}
    full_env.update(
        PATH=os.pathsep.join([str(bin_dir), *dirs]),
        FAKE_LOG=str(log),
        FAKE_PYTHON=sys.executable,
        PYTHON=str(bin_dir / "python"),
        **env,
    )
    proc = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc, [c["argv"] for c in map(json.loads, log.read_text().splitlines())]


def test_gpu_smoke_installs_runs_the_gpu_tier_and_the_demo(tmp_path):
    proc, calls = _gpu_smoke(tmp_path, "train.lr=1e-4", FAKE_GPUS="2")
    assert proc.returncode == 0, proc.stderr
    assert "gpu_smoke.sh: OK on 2 GPU(s)" in proc.stdout
    torch_install, install, cuda_check, pytest_call, demo = calls
    assert torch_install == ["-m", "pip", "install", "torch==2.14.1", "packaging", "wheel"]
    assert install == ["-m", "pip", "install", "--no-build-isolation", "-e", ".[te,dev]"]
    assert cuda_check == ["-", "2"]
    assert pytest_call == ["-m", "pytest", "-q", "-rs", "-m", "gpu", "tests/gpu"]
    assert demo[:7] == ["-m", "megatron_earl.cli.main", "train", "--nproc", "2", "--config",
                        "configs/demo_cpu.yaml"]  # fmt: skip
    assert "steps=3" in demo and demo[-1] == "train.lr=1e-4"
    assert not any(a.startswith("layouts.") for a in demo)  # the demo's own 2-rank layouts


def test_gpu_smoke_lays_the_demo_out_for_n_gpus(tmp_path):
    proc, calls = _gpu_smoke(tmp_path, FAKE_GPUS="4", EARL_SKIP_INSTALL="1")
    assert proc.returncode == 0, proc.stderr
    assert calls[0] == ["-", "4"]  # no pip install
    demo = calls[-1]
    assert demo[4] == "4" and "layouts.train=tp1cp1pp1dp4" in demo


@pytest.mark.parametrize(
    "env,fragment",
    [
        ({"FAKE_GPUS": "0"}, "NGPUS=0 but nvidia-smi lists 0 GPU(s)"),
        ({"FAKE_GPUS": "2", "NGPUS": "4"}, "NGPUS=4 but nvidia-smi lists 2 GPU(s); valid: 1..2"),
    ],
)
def test_gpu_smoke_refuses_missing_gpus_before_installing(tmp_path, env, fragment):
    proc, calls = _gpu_smoke(tmp_path, **env)
    assert proc.returncode == 2 and fragment in proc.stderr
    assert calls == []


def test_gpu_smoke_needs_nvidia_smi(tmp_path):
    proc, calls = _gpu_smoke(tmp_path, smi=False)
    assert proc.returncode == 2 and "nvidia-smi not found" in proc.stderr and calls == []


def test_gpu_smoke_fails_when_the_gpu_tests_fail(tmp_path):
    proc, calls = _gpu_smoke(tmp_path, FAKE_GPUS="1", FAKE_PYTEST_RC="1")
    assert proc.returncode == 1
    assert calls[-1][:2] == ["-m", "pytest"]  # the demo does not start
