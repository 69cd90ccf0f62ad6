"""The JSON Schema of ``phasewise replay --json`` output (one object per line, each with a ``type``).

Written next to the topics' schemas as ``ReplayOutput.v1.json``; docs/results.md describes the lines.
"""

from __future__ import annotations

from typing import Any

__all__ = ["replay_output_schema", "SCHEMA_NAME"]

SCHEMA_NAME = "ReplayOutput.v1.json"

_NUM_OR_NULL = {"type": ["number", "null"]}
_COUNT = {"type": "integer", "minimum": 0}


def _share(doc: str) -> dict[str, Any]:
    return {"type": ["number", "null"], "minimum": 0, "maximum": 1, "description": doc}


def _num(doc: str) -> dict[str, Any]:
    return {**_NUM_OR_NULL, "description": doc}


def _obj(props: dict[str, Any], required: list[str], doc: str) -> dict[str, Any]:
    missing = [r for r in required if r not in props]
    assert not missing, missing
    return {"type": "object", "description": doc, "properties": props, "required": required,
            "additionalProperties": False}


def _member_score() -> dict[str, Any]:
    return _obj({"alloc_over_used": _num("sum(L dt) / sum(U dt); null when nothing was used"),
                 "fulfilment": _share("share of scored steps with U <= L; null when none was scored"),
                 "steps": _COUNT},
                ["alloc_over_used", "fulfilment", "steps"], "one member's score")


def _setup() -> dict[str, Any]:
    counts = {"type": "object", "additionalProperties": _COUNT,
              "description": "file (and column) -> how many values"}
    trace = _obj({
        "format": {"type": "string", "description": "trace layout (ai4dl, genai2026, phasewise: a recording)"},
        "source": {"type": "string", "description": "the file or folder read"},
        "containers": _COUNT,
        "samples": _COUNT,
        "units": {"type": "object", "additionalProperties": {"type": "string"}, "description": "resource -> unit"},
        "time_unit": {"type": "string", "description": "the timestamps' unit"},
        "notes": {"type": "array", "items": {"type": "string"}, "description": "what loading changed, in words"},
        "negative_clipped": {**counts, "description": "negative usage values clipped to 0"},
        "non_finite_missing": {**counts, "description": "NaN or infinite usage values treated as missing"},
    }, ["format", "source", "containers", "samples", "units", "time_unit", "notes", "negative_clipped",
        "non_finite_missing"], "the replayed trace")
    per_resource = {"type": "object", "additionalProperties": {"type": "number"}}
    props: dict[str, Any] = {
        "type": {"const": "setup"},
        "command": {"type": "string", "description": "the command line that reproduces the run"},
        "trace": trace,
        "policies": {"type": "array", "items": {"type": "string"}, "description": "every policy replayed"},
        "phase_model": {"enum": ["container", "fleet", "worker", None],
                        "description": "how the phase policy ran; null when it was not in the run"},
        "phase_start": {"type": ["object", "null"], "additionalProperties": _COUNT,
                        "description": "how the phase model started -> containers; null without phase policy"},
        "split": {"enum": ["all", "tune", "holdout"]},
        "windows": {"type": "array", "items": {"type": "integer", "minimum": 1}},
        "through_kafka": {"type": "boolean"},
        "elapsed_s": {"type": "number", "minimum": 0, "description": "replay time in-process"},
        # --phase-model worker / --through-kafka with phase
        "pretrained": {"type": "boolean"},
        "pretrained_model": {"enum": ["corpus", "ai4dl", None],
                             "description": "the shipped model the worker started from; null: cold"},
        "frozen": {"type": "boolean"},
        "safety_rules": {"type": "boolean", "description": "the worker's live safety rules bounded its decisions"},
        "statistics": {"enum": ["relative", "absolute"]},
        "model_origin": {"type": ["string", "null"]},
        "snapshots": {"type": ["integer", "null"], "minimum": 0},
        "phase_features": {"type": ["string", "null"]},
        "decisions": {"type": ["integer", "null"], "minimum": 0},
        # --phase-model fleet
        "quantile": {"type": "number"},
        "margin": {"type": "number"},
        "level_half_life": {"type": "number"},
        "ratio_cap": _NUM_OR_NULL,
        "target_fulfilment": _NUM_OR_NULL,
        "pretrain_folds": _COUNT,
        "resource_quantiles": per_resource,
        "resource_margins": per_resource,
    }
    return _obj(props, ["type", "command", "trace", "policies", "phase_model", "phase_start", "split", "windows",
                        "through_kafka", "elapsed_s"], "what was replayed, how (first line)")


def _score() -> dict[str, Any]:
    props = {
        "type": {"const": "score"},
        "policy": {"type": "string", "description": "policy family: vpa, window, phase, oracle"},
        "resource": {"type": "string"},
        "alloc_over_used": _num("sum(L dt) / sum(U dt) over containers (1 = the oracle)"),
        "fulfilment": _share("share of scored steps with U <= L"),
        "steps": _COUNT,
        "unit": {"type": "string", "description": "the resource's unit in the trace"},
        "containers": {**_COUNT, "description": "containers with at least one scored step"},
        "member": {"type": "string", "description": "window: the member shown in this row"},
        "member_choice": {"type": "string", "description": "window: how the member was picked"},
        "members": {"type": "object", "additionalProperties": {"$ref": "#/$defs/member_score"},
                    "description": "window: every member's score"},
        "note": {"type": "string"},
    }
    return _obj(props, ["type", "policy", "resource", "alloc_over_used", "fulfilment", "steps", "unit",
                        "containers"], "one policy family on one resource, summed over containers")


def _savings() -> dict[str, Any]:
    vertex = _obj({"member": {"type": "string"}, "alloc_over_used": {"type": "number"},
                   "fulfilment": {"type": "number", "minimum": 0, "maximum": 1}},
                  ["member", "alloc_over_used", "fulfilment"], "a reactive member on the frontier")
    props = {
        "type": {"const": "savings"},
        "resource": {"type": "string"},
        "slack_cut_vs_frontier": _num(
            "1 - (phase - 1) / (R - 1): share of the reactive frontier's slack (allocation - use) the phase "
            "policy removes at its fulfilment; null when not computed or R < 1.01 (less slack than that to cut)"),
        "alloc_cut_vs_frontier": _num("1 - phase / R: share of the frontier's allocation the phase policy saves"),
        "savings_vs_best_reactive": _num(
            "1 - phase / B, B = the cheapest single reactive baseline at >= the phase policy's fulfilment"),
        "frontier_alloc_at_phase_fulfilment": _num(
            "R: the least alloc/used of any reactive member, or linear mix of two, at >= the phase "
            "policy's fulfilment"),
        "frontier_fulfilment": _share("the fulfilment R is taken at (the phase policy's, or the highest "
                                      "reactive one when the phase policy's is above every member's)"),
        "frontier_mix": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1},
                         "description": "the member(s) reaching R -> share of time"},
        "phase_fulfilment_above_every_reactive": {"type": "boolean"},
        "frontier": {"type": "array", "items": vertex,
                     "description": "the members on the frontier, by increasing fulfilment"},
        "frontier_note": {"type": "string"},
        "slack_note": {"type": "string"},
        "best_reactive": {"type": "string"},
        "best_reactive_alloc_over_used": _NUM_OR_NULL,
        "best_reactive_fulfilment": _NUM_OR_NULL,
        "phase_alloc_over_used": _NUM_OR_NULL,
        "phase_fulfilment": _NUM_OR_NULL,
        "matched_fulfilment": {"type": "boolean",
                               "description": "false: no single baseline reaches the phase policy's fulfilment"},
        "flag": {"type": "string"},
        "reason": {"type": "string", "description": "why nothing was computed"},
        "oracle_alloc_over_used": _NUM_OR_NULL,
        "steps": _COUNT,
        "warmup_steps_not_scored": _COUNT,
    }
    return _obj(props, ["type", "resource", "slack_cut_vs_frontier", "alloc_cut_vs_frontier",
                        "savings_vs_best_reactive", "steps", "warmup_steps_not_scored"],
                "the phase policy against the reactive baselines on one resource")


def replay_output_schema() -> dict[str, Any]:
    """The schema every line of ``phasewise replay --json`` validates against."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"phasewise/{SCHEMA_NAME}",
        "title": "ReplayOutput",
        "description": ("One line of `phasewise replay --json`: a setup line, then one score line per policy "
                        "family and resource, then one savings line per resource."),
        "oneOf": [{"$ref": "#/$defs/setup"}, {"$ref": "#/$defs/score"}, {"$ref": "#/$defs/savings"}],
        "$defs": {"setup": _setup(), "score": _score(), "savings": _savings(), "member_score": _member_score()},
    }
