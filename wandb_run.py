"""wandb for train.py, sample.py and compare.py: online with credentials, offline (never blocking) without them.

An offline run is written beside its checkpoints and uploaded later with `wandb sync <dir>`.
"""

from __future__ import annotations

import os


def open_wandb_run(wandb, kwargs: dict, without: str, log=print):
    """wandb.init(**kwargs): online with credentials (or WANDB_MODE), else offline, never blocking; None, after
    saying so through `log` (`without`: what happens instead), when not even an offline run can start."""
    mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_has_credentials() else "offline")
    if mode != "offline":
        try:
            return wandb.init(mode=mode, settings=wandb.Settings(init_timeout=20), **kwargs)
        except Exception as e:  # network down, bad key, service unreachable: go on, offline
            log(f"wandb: online init failed ({type(e).__name__}: {e}); falling back to offline mode")
    try:
        run = wandb.init(mode="offline", **kwargs)
    except Exception as e:  # an unwritable WANDB_DIR, a broken install
        log(f"wandb: offline init failed too ({type(e).__name__}: {e}); {without}")
        return None
    where = os.path.dirname(run.dir)
    log(f"wandb: offline run in {where}; upload it later with: wandb sync {where}")
    return run


def _wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = os.path.join(os.path.expanduser("~"), ".netrc")
    return os.path.isfile(netrc) and "api.wandb.ai" in open(netrc, encoding="utf-8", errors="replace").read()
