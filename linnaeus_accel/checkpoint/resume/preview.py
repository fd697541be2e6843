"""What ``plan`` says about resuming: the checkpoint a run would resume from (``--resume``, or the
newest complete one in the config's output directory) and what a new run length changes there.

Read without verifying digests (``plan`` trains nothing and must stay quick): ``train`` verifies
the checkpoint before it resumes, and says the same lines again at the resume step.
"""

from __future__ import annotations

from pathlib import Path

from ...schedule import ResolvedPlan
from ..state.files import STATE_FILE, checkpoint_store, read_json
from .config_changes import resume_notes


def resume_preview(output_dir: Path, plan: ResolvedPlan, explicit: str | Path | None) -> list[str]:
    """Lines for ``plan``: where this config's run (in ``output_dir``) resumes and what a new run
    length changes there (empty: it starts from step 0, or resumes on the plan it was trained on)."""
    if explicit is not None:
        path: Path | None = Path(explicit)
    else:
        store = checkpoint_store(output_dir / "checkpoints")
        steps = store.complete_steps()
        path = store.final_path(steps[-1]) if steps else None
    if path is None:
        return []
    state, problem = read_json(path / STATE_FILE)
    if problem is not None or not isinstance(state, dict):
        return [f"{path} cannot be read as a checkpoint ({problem}): train will say why"]
    done = int(state.get("progress", {}).get("global_step", 0))
    notes = resume_notes(state.get("config"), state.get("plan"), plan, done)
    if done > plan.total_steps:
        notes = [
            f"this config ends the run at step {plan.total_steps}, before the {done} steps trained: train refuses it"
        ]
    return [f"resumes at step {done} from {path}", *notes] if notes else []  # said when it changes something
