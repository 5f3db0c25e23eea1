"""A CPU check of the forward's plane kernels' hand-offs (cc/ops/gated_delta_rule.cu):

- recurrence_planes_kernel<_, false> reads each chunk's decay a step ahead, as it reads the base: over
  over_chunks' order of calls (ahead, load, then per step turn, load of the next chunk, step), step i
  must take chunk i's decay and base, for any number of chunks.

A hand-off a step late is checked to fail, so the check can.

    python3 tools/delta_rule_forward_check.py
"""

from __future__ import annotations


def recurrence_steps(chunks: int, late: bool = False, next_taken: bool = False) -> list[tuple[int, int]]:
    """The (decay, base) each step takes: chunk i's decay and base are i. late: turn() after the next
    load (the mutation delta_rule_recurrence_base_a_step_late); next_taken: the step reads next_dec
    (delta_rule_recurrence_decay_of_next_chunk)."""
    reg = {"next_base": None, "base": None, "next_dec": None, "dec_ahead": None}

    def load(chunk: int) -> None:
        reg["next_base"], reg["next_dec"] = chunk, chunk

    def turn() -> None:
        reg["base"], reg["dec_ahead"] = reg["next_base"], reg["next_dec"]

    taken = []
    if chunks > 0:
        load(0)
    for i in range(chunks):
        if not late:
            turn()
        if i + 1 < chunks:
            load(i + 1)
        if late:
            turn()
        taken.append((reg["next_dec"] if next_taken else reg["dec_ahead"], reg["base"]))
    return taken


def check_recurrence(**mutation: bool) -> None:
    for chunks in range(7):
        got = recurrence_steps(chunks, **mutation)
        assert got == [(i, i) for i in range(chunks)], (chunks, got)


def main() -> int:
    check_recurrence()
    for mutation in ({"late": True}, {"next_taken": True}):
        try:
            check_recurrence(**mutation)
        except AssertionError:
            pass
        else:
            raise AssertionError(f"a hand-off a step off passed: {mutation}")
    print("recurrence_planes: step i takes chunk i's decay and base (0 to 6 chunks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
