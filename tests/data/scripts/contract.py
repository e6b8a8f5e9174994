"""What a script sees of torchrun's contract, written to OUT/<rank>.json; then it ends as told.

torchrun --nproc-per-node 2 contract.py OUT [--exit N | --os-exit N | --raise | --no-destroy | --leak]
"""

import json
import os
import sys
import threading
import time

import torch.distributed as dist

out, how = sys.argv[1], sys.argv[2:]
dist.init_process_group()
seen = {"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd()}
seen.update(env=dict(os.environ), rank=dist.get_rank(), world=dist.get_world_size(), backend=dist.get_backend())
seen.update(pid=os.getpid(), sid=os.getsid(0))
with open(os.path.join(out, f"{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
dist.barrier()
if "--leak" in how:  # a thread that never ends and a global the next run must not see
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    os.environ["LEAKED_BY_THE_LAST_SCRIPT"] = "1"
if "--raise" in how and dist.get_rank() == 1:
    raise ValueError("rank 1 fails on purpose")
if "--exit" in how and dist.get_rank() == 1:
    sys.exit(int(how[how.index("--exit") + 1]))
if "--os-exit" in how and dist.get_rank() == 0:
    os._exit(int(how[how.index("--os-exit") + 1]))
if "--no-destroy" not in how:
    dist.destroy_process_group()
