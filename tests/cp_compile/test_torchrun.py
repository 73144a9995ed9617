"""init_parallel under a real `torchrun` launch (env:// rendezvous), not only the harness."""

import os
import subprocess
import sys
from pathlib import Path


def test_torchrun_launch_runs_dcp():
    script = Path(__file__).with_name("torchrun_dcp_smoke.py")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0 backend=gloo dcp_rank=0 OK" in proc.stdout and "rank 1 backend=gloo dcp_rank=1 OK" in proc.stdout
