"""The workloads shipped with the project, and the scripted agent of the experiments.

- "math": one long generation per trajectory, no sandbox; the reward is 1 when the last number
  in the response equals the answer.
- "shell": multi-turn tasks in busybox sandboxes. A setup action writes the task's files and its
  check script; each turn the agent's action runs in the sandbox and its output is the next
  observation; the reward is the exit status of the check (0: reward 1). Needs the tiny-4k preset
  (or a model with at least 4,096 positions): a trajectory's context grows past 512 tokens.
- "lookup": the agentic task the trainer learns (services/trainer/tasks.py). The setup writes a
  random code into the file `code`, out of the agent's sight; the agent's first turn is one
  token that picks an action from a menu of four, three of which print the code and one its size;
  it sees the action's output; its second turn is the code's digits, passed to the check as its
  argument. The check prints the fraction of digits right in place (the reward: 1 only for the
  exact code) and exits 0 on the exact code. Each turn draws only from its own token set
  (`Choice`), so the model acts directly, with no script between its tokens and the sandbox.

The built-in model does not solve "math" or "shell"; the trajectories, failures and recoveries are
real. It learns "lookup" in a few minutes of GRPO.

The scripted agent (`scripted=True`, what the experiments use, and labelled so wherever their
results appear): the engine still generates every response, but its length is drawn from one
stated distribution, RESPONSE_TOKENS, keyed by (trajectory seed, step), and EOS is masked until
it is reached; the action is picked from the task's menu by the generated tokens (their sum
modulo the menu's length), so a wrong context after a recovery picks other actions. Unscripted,
the action is the first line of the response that starts with "$ " (else a no-op), and the
response ends where the model ends it.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

from belayer_rl.shared import tokenizer

# The scripted response length, in tokens: uniform on [lo, hi], the same for every policy compared.
RESPONSE_TOKENS = (96, 288)
NO_OP = "true"
OBSERVATION_LIMIT = 400  # bytes of an action's output that reach the context


@dataclass(frozen=True)
class Choice:
    """A turn whose response is `length` tokens drawn from `allowed` alone (the engine's
    allowed_tokens): the trainer computes its log-probs over the same set."""

    allowed: tuple[int, ...]
    length: int

    def __post_init__(self) -> None:
        if not self.allowed or self.length < 1:
            raise ValueError(f"a choice needs allowed tokens and a length >= 1, got {self}")


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    max_turns: int  # LLM turns; a shell task's last action is its check
    setup: str = ""  # shell: the first action, writing the task's files (empty: no sandbox)
    check: str = ""  # shell: run as the last action; exit 0 means solved
    menu: tuple[str, ...] = ()  # shell: the scripted agent's actions
    answer: str = ""  # math: the exact answer
    max_tokens: int = 256  # per response, unscripted
    # shell: each action turn is this choice, the action menu[its token's index in the set]
    choose_turn: Choice | None = None
    # shell: the last turn is this choice, its decoded tokens the check's argument
    answer_turn: Choice | None = None
    setup_seen: bool = True  # whether the setup's observation joins the context
    # What the agent sees of an action: "command", its command line, output and exit status
    # (`observation`); "output", its output alone.
    observe: Literal["command", "output"] = "command"
    # Whether the check prints a score, "<right>/<of>", as its last line: the reward is that
    # fraction. Otherwise the reward is 1 when the check exits 0 and 0 when it does not.
    scored: bool = False

    def __post_init__(self) -> None:
        if self.choose_turn is not None and len(self.choose_turn.allowed) != len(self.menu):
            raise ValueError(f"{self.task_id}: one allowed token per menu action")

    @property
    def needs_sandbox(self) -> bool:
        return bool(self.setup)


def seeded(*parts: object) -> random.Random:
    """A generator keyed by `parts` alone (no global state, the same in every process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def response_tokens(trajectory_seed: int, step: int) -> int:
    lo, hi = RESPONSE_TOKENS
    return seeded("response-length", trajectory_seed, step).randint(lo, hi)


def turn_seed(trajectory_seed: int, step: int) -> int:
    """The sampling seed of the turn that follows `step` actions: a resumed turn draws the same."""
    return seeded("turn", trajectory_seed, step).randrange(1 << 62)


def choose_action(task: Task, response: list[int], scripted: bool) -> str:
    if scripted:
        return task.menu[sum(response) % len(task.menu)]
    for line in tokenizer.decode(response).splitlines():
        if line.startswith("$ ") and line[2:].strip():
            return line[2:].strip()
    return NO_OP


def observation(command: str, exit_code: int, stdout: str, stderr: str, timed_out: bool) -> str:
    """What the agent sees of an action: its command, its output (bounded) and its exit status.
    Only ever built from an action's result: an environment failure is never an observation."""
    output = (stdout + stderr)[-OBSERVATION_LIMIT:]
    status = "timed out" if timed_out else f"exit {exit_code}"
    return f"\n$ {command}\n{output}[{status}]\n"


def seen_output(stdout: str, stderr: str) -> str:
    """What the agent sees of an action in a task that observes outputs alone (bounded)."""
    return (stdout + stderr)[-OBSERVATION_LIMIT:]


SCORE = re.compile(r"(\d+)/(\d+)")


def check_score(output: str) -> float:
    """The score a scored check printed as its last line; ValueError when there is none."""
    lines = output.strip().splitlines()
    found = SCORE.fullmatch(lines[-1].strip()) if lines else None
    if found is None or not 0 <= int(found[1]) <= int(found[2]) or int(found[2]) == 0:
        raise ValueError(f"the check printed no score <right>/<of>: {output[-80:]!r}")
    return int(found[1]) / int(found[2])


def math_reward(task: Task, response: list[int]) -> float:
    numbers = re.findall(r"-?\d+", tokenizer.decode(response))
    return 1.0 if numbers and numbers[-1] == task.answer else 0.0


# ---------------------------------------------------------------- the shipped workloads


def math_tasks(count: int) -> list[Task]:
    tasks = []
    for i in range(count):
        rng = seeded("math", i)
        a, b, c = rng.randint(10, 99), rng.randint(10, 99), rng.randint(2, 9)
        tasks.append(
            Task(
                task_id=f"math-{i}",
                prompt=f"Compute ({a} + {b}) * {c}. Think step by step, then give the number.\n",
                max_turns=1,
                answer=str((a + b) * c),
                max_tokens=400,
            )
        )
    return tasks


SHELL_MENU = (
    "ls /tmp/task",
    "cat /tmp/task/notes.txt",
    "wc -l /tmp/task/notes.txt",
    "sort /tmp/task/notes.txt > /tmp/task/sorted.txt; head -3 /tmp/task/sorted.txt",
    "echo step >> /tmp/task/log; wc -l /tmp/task/log",
    "sed -i 's/todo/done/' /tmp/task/notes.txt; grep -c done /tmp/task/notes.txt",
    "cat /tmp/task/log 2>/dev/null | tail -2",
    "sh /tmp/task/check.sh; echo check=$?",
)


def shell_tasks(count: int, turns: int = 8, action_s: float = 0.3) -> list[Task]:
    """`action_s`: how long each menu action takes (a sleep first), the environment time of a step."""
    tasks = []
    for i in range(count):
        rng = seeded("shell", i)
        lines = [f"{rng.choice(['todo', 'note', 'fix'])} item {rng.randint(1, 999)}" for _ in range(6)]
        notes = "\\n".join(lines)
        wait = f"sleep {action_s:g}; " if action_s > 0 else ""
        tasks.append(
            Task(
                task_id=f"shell-{i}",
                prompt=(
                    "You are in a shell. Replace every 'todo' in /tmp/task/notes.txt with 'done', then run"
                    " the check. Answer with one command per turn, on a line starting with '$ '.\n"
                ),
                max_turns=turns,
                setup=(
                    f"mkdir -p /tmp/task && printf '{notes}\\n' > /tmp/task/notes.txt && "
                    "printf '! grep -q todo /tmp/task/notes.txt\\n' > /tmp/task/check.sh && ls /tmp/task"
                ),
                check="sh /tmp/task/check.sh",
                menu=tuple(wait + action for action in SHELL_MENU),
            )
        )
    return tasks


DIGITS = "0123456789"
DIGIT_TOKENS = tuple(tokenizer.encode(DIGITS))
LOOKUP_PROMPT = "find the code\n"
# The action menu, one token each: three actions print the code, the last only its size. Paths are
# relative: the sandbox's working folder (a container's /tmp, a scratch folder without Docker)
# holds the files.
LOOKUP_MENU = ("cat code", "head -n 1 code", "tail -n 1 code", "wc -c code")
MENU_TOKENS = tuple(tokenizer.encode("abcd"))
# The check: the characters of its argument right in place, of the longer of it and the code (so
# only the exact code scores 1) on a line of its own, then exit 0 on the exact code.
LOOKUP_CHECK = """c=$(cat code); a=$1; n=0; i=1; m=${#c}; [ "${#a}" -gt "$m" ] && m=${#a}
while [ "$i" -le "$m" ]; do
  [ "$(printf %s "$a" | cut -c "$i")" = "$(printf %s "$c" | cut -c "$i")" ] && n=$((n + 1))
  i=$((i + 1))
done
printf '\n%s/%s\n' "$n" "$m"
[ "$a" = "$c" ]"""


CONTROL_ACTION = "echo -"  # the control's every action: the same observation whatever the code


def lookup_task(code: str, control: bool = False) -> Task:
    """The lookup task for one code (digits). The setup's command names the code, so its
    observation stays out of the context: the code reaches the agent only through an action.
    The `control` task's actions all print one constant."""
    if not code.isdigit() or not 1 <= len(code) <= 6:
        raise ValueError(f"a lookup code is 1 to 6 digits, got {code!r}")
    return Task(
        task_id=f"lookup-{code}",
        prompt=LOOKUP_PROMPT,
        max_turns=2,
        setup=f"echo {code} > code && cat > check.sh <<'END'\n{LOOKUP_CHECK}\nEND",
        check="sh check.sh",
        menu=(CONTROL_ACTION,) * len(LOOKUP_MENU) if control else LOOKUP_MENU,
        choose_turn=Choice(MENU_TOKENS, 1),
        answer_turn=Choice(DIGIT_TOKENS, len(code)),
        setup_seen=False,
        observe="output",
        scored=True,
    )


def lookup_tasks(count: int, digits: int = 3) -> list[Task]:
    return [lookup_task(f"{seeded('lookup', i).randrange(10**digits):0{digits}d}") for i in range(count)]


WORKLOADS = ("math", "shell", "lookup")


def workload(name: str, count: int, **options: float) -> list[Task]:
    if name == "math":
        return math_tasks(count)
    if name == "shell":
        return shell_tasks(count, **options)  # type: ignore[arg-type]  # turns (whole) and action_s, as the shell workload's flags give them
    if name == "lookup":
        return lookup_tasks(count)
    raise ValueError(f"unknown workload {name!r}: {', '.join(WORKLOADS)}")
