"""`ptq plan`: will it fit, what binds, which scheme, before any weights are loaded.

    facts = read_model("meta-llama/Meta-Llama-3-8B")        # config.json + safetensors headers
    work = workload(context=8192)
    estimates = evaluate_candidates(facts, accelerator("H100"), work)
    chosen, why = recommend(estimates, work)

Layers: accelerators (the table), arithmetic (bytes and FLOPs, pure), model (what a model
is made of, from its config and headers), estimate (bounds per scheme, the recommendation),
render (text, JSON, plot). Nothing here runs a model; `ptq plan --measure` does, through
ptq.engine_bench.
"""

from ptq.plan.accelerators import ACCELERATORS, Accelerator, accelerator, custom
from ptq.plan.estimate import (STANDARD, Candidate, Estimate, Workload, candidate_from_recipe, estimate,
                               evaluate_candidates, recommend, workload)
from ptq.plan.model import ModelFacts, facts_from_config, read_model

__all__ = [
    "ACCELERATORS", "STANDARD", "Accelerator", "Candidate", "Estimate", "ModelFacts", "Workload", "accelerator",
    "candidate_from_recipe", "custom", "estimate", "evaluate_candidates", "facts_from_config", "read_model",
    "recommend", "workload",
]
