"""`belayer policy explain`: the checkpoint decision and its terms for inputs given on the command
line, without a cluster (services/policy/decision.py is the arithmetic the policy service runs).

    belayer policy explain --samples 2,4,6 --elapsed 1 --cost 0.5 --p 0.01 --exposure 30 [--json]

`--p` is the step's failure probability p_t and `--exposure` its C_t; `--samples ''` means no
response times yet. `--contention` is K, the LLM seconds a checkpoint's CPU costs per second it runs
(0 by default: a machine with cores to spare). `--step`, `--env-work`, `--in-flight` and
`--cooldown` reach the guards.
"""

from __future__ import annotations

import argparse
import json
import math

from belayer_rl.services.policy.decision import Guards, Policy, ResponseTimes, Situation, decide


def add_parser(commands: argparse._SubParsersAction) -> None:
    policy = commands.add_parser("policy", help="the checkpoint policy")
    verbs = policy.add_subparsers(dest="verb", required=True)
    explain = verbs.add_parser("explain", help="a decision and its terms, for given inputs (no cluster)")
    explain.add_argument(
        "--samples", required=True, help="LLM response times in seconds, comma-separated ('' for none)"
    )
    explain.add_argument(
        "--elapsed", type=float, required=True, help="x: seconds already waited for the response"
    )
    explain.add_argument("--cost", type=float, required=True, help="c: the checkpoint cost in seconds")
    explain.add_argument("--p", type=float, required=True, help="p_t: the step's failure probability")
    explain.add_argument(
        "--exposure",
        type=float,
        required=True,
        help="C_t: seconds of work a failure would make the trajectory redo",
    )
    explain.add_argument(
        "--contention", type=float, default=0.0, help="K: LLM seconds lost per second a checkpoint runs"
    )
    explain.add_argument("--policy", default="adaptive", help="adaptive, never, always or every-N")
    explain.add_argument(
        "--step", type=int, default=Guards().min_step, help="actions completed (default: the min step)"
    )
    explain.add_argument(
        "--env-work",
        type=float,
        default=None,
        help="environment seconds since the last checkpoint (default: enough)",
    )
    explain.add_argument("--in-flight", action="store_true", help="a checkpoint of the trajectory is running")
    explain.add_argument("--cooldown", type=float, default=0.0, help="seconds of the host's cooldown left")
    explain.add_argument("--json", action="store_true")
    explain.set_defaults(run=cmd_explain)


def parse_samples(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise SystemExit(
            f"belayer policy explain: --samples must be numbers separated by commas: {exc}"
        ) from None


def cmd_explain(args: argparse.Namespace) -> int:
    try:
        policy = Policy.parse(args.policy)
    except ValueError as exc:
        raise SystemExit(f"belayer policy explain: {exc}") from None
    guards = Guards()
    responses = ResponseTimes.of(parse_samples(args.samples))
    situation = Situation(
        step=args.step,
        exposure_s=args.exposure,
        env_work_s=guards.min_env_work_s if args.env_work is None else args.env_work,
        elapsed_s=args.elapsed,
        in_flight=args.in_flight,
        cooldown_left_s=args.cooldown,
    )
    verdict = decide(
        policy,
        situation,
        p=args.p,
        responses=responses,
        cost_s=args.cost,
        contention=args.contention,
        guards=guards,
    )
    visible = verdict.expected_visible_cost_s
    report = {
        "policy": policy.name,
        "checkpoint": verdict.checkpoint,
        "reason": verdict.reason,
        "expected_visible_cost_s": visible,
        "q": verdict.survival,
        "benefit_s": verdict.benefit_s,
        "p": verdict.p,
        "exposure_s": situation.exposure_s,
        "elapsed_s": situation.elapsed_s,
        "cost_s": verdict.cost_s,
        "samples": verdict.samples,
        "contention": verdict.contention,
        "contention_cost_s": verdict.contention_cost_s,
    }
    if args.json:  # strict JSON has no NaN or infinity: those are written as strings
        print(
            json.dumps(
                {k: v if not isinstance(v, float) or math.isfinite(v) else str(v) for k, v in report.items()}
            )
        )
        return 0
    print(f"decision: {'checkpoint' if verdict.checkpoint else 'no checkpoint'} ({policy.name})")
    print(f"reason:   {verdict.reason}")
    print(f"  p = {verdict.p:.6g}, C = {situation.exposure_s:.6g} s: benefit p·C = {verdict.benefit_s:.6g} s")
    print(
        f"  x = {situation.elapsed_s:.6g} s, c = {verdict.cost_s:.6g} s, {verdict.samples} samples:"
        f" q(x;c) = {verdict.survival:.6g}, expected visible cost = {visible:.6g} s"
    )
    print(f"  K = {verdict.contention:.6g}: contention cost K·c = {verdict.contention_cost_s:.6g} s")
    return 0
