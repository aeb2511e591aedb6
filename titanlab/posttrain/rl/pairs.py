"""Preference pairs for DPO: (prompt, chosen, rejected) token ids, from a digit task or a JSONL
file, in a reproducible per-rank order whose position is checkpointed like the data loader's.

JSONL: one `{"prompt": str, "chosen": str, "rejected": str}` per line. The prompt is rendered
as a user turn with the tokenizer's chat template (`titanlab.data.chat.render_chat_prompt`);
each completion is its text's tokens followed by one end token (`completion_end`):
- a Llama 3 format tokenizer: `<|eot_id|>`, the template's end of turn. That is the last token
  titanlab's chat SFT trains in every assistant turn (`titanlab.data.prepare_chat`; the EOS it
  appends after the conversation is a sample separator, never a target), so DPO after titanlab
  SFT ends an answer the way the SFT model learned to.
- a tokenizer.json: the tokenizer's EOS (`eos_token` of tokenizer_config.json), as TRL's
  DPOTrainer appends to each completion, even where the template ends a turn with another
  token (Qwen3-Base: EOS `<|endoftext|>`, end of turn `<|im_end|>`). titanlab's chat SFT takes
  no tokenizer.json, so a model DPO'd here came from elsewhere, and TRL is what its results are
  compared with. Generation stops at either (`ChatPrompt.stop_ids`).
Line i is held out for evaluation when i % 16 == 0 (never drawn for training).
"""

from __future__ import annotations

import random
from typing import Any

from titanlab.config.errors import ConfigError
from titanlab.data.chat import render_chat_prompt
from titanlab.data.digit_tasks import HELD_OUT_EVERY, DigitTask
from titanlab.data.tokenizer import AnyTokenizer, Tokenizer
from titanlab.posttrain.rl.prompts import check_reference, jsonl_rows

Pair = tuple[list[int], list[int], list[int]]


def completion_end(tokenizer: AnyTokenizer) -> int:
    """The id that ends every DPO completion: `<|eot_id|>` for a Llama 3 format tokenizer, the
    tokenizer's EOS for a tokenizer.json (the module docstring says why)."""
    return tokenizer.eot_id if isinstance(tokenizer, Tokenizer) else tokenizer.eos_id


def read_pairs(path: str, tokenizer: AnyTokenizer) -> list[Pair]:
    """Every pair of the JSONL file at `path`, tokenized. Raises ConfigError (one line naming
    the line) for a missing file, bad JSON, a missing or non-string field, or an empty
    completion."""
    pairs = []
    for where, row in jsonl_rows(path, ("prompt", "chosen", "rejected")):
        for key in ("chosen", "rejected"):
            if not row[key].strip():
                raise ConfigError(f'{where}: "{key}" is empty; a preference needs two completions')
        prompt = render_chat_prompt(tokenizer, [{"role": "user", "content": row["prompt"]}])
        end = [completion_end(tokenizer)]
        completion = [tokenizer.encode(row[k], bos=False, eos=False) + end
                      for k in ("chosen", "rejected")]  # fmt: skip
        pairs.append((prompt.ids, completion[0], completion[1]))
    if len(pairs) < HELD_OUT_EVERY + 1:
        raise ConfigError(
            f"rl.data_path={path!r} has {len(pairs)} pairs; DPO needs at least "
            f"{HELD_OUT_EVERY + 1} (one in {HELD_OUT_EVERY} is held out)"
        )
    return pairs


class PairStream:
    """This data-parallel rank's training pairs: pair i of rank r comes from a generator seeded
    by (seed, r, i) (digit tasks), or is the (i·dp + r)-th of the training lines in an order
    reshuffled every epoch (JSONL); the state is the count handed out.

    Args:
        source: a DigitTask, or the pairs of `read_pairs`.
    """

    def __init__(self, source: DigitTask | list[Pair], seed: int, dp_rank: int, dp: int) -> None:
        self.source, self.seed, self.dp_rank, self.dp = source, seed, dp_rank, dp
        self.drawn = 0
        self.reference = ""  # what the run's reference policy is (`check_reference`)
        if isinstance(source, list):
            self.train = [p for i, p in enumerate(source) if i % HELD_OUT_EVERY]
            self.held_out = [p for i, p in enumerate(source) if i % HELD_OUT_EVERY == 0]

    def next(self, n: int) -> list[Pair]:
        out = []
        for _ in range(n):
            if isinstance(self.source, DigitTask):
                rng = random.Random(f"pair:{self.seed}:{self.dp_rank}:{self.drawn}")
                out.append(self.source.preference_pair(rng, held_out=False))
            else:
                index = self.drawn * self.dp + self.dp_rank
                epoch, at = divmod(index, len(self.train))
                order = list(range(len(self.train)))
                random.Random(f"pairs:{self.seed}:{epoch}").shuffle(order)
                out.append(self.train[order[at]])
            self.drawn += 1
        return out

    def evaluation_pairs(self, n: int) -> list[Pair]:
        """The held-out pairs (at most `n`), the same on every rank."""
        if isinstance(self.source, DigitTask):
            rng = random.Random(f"held-out-pairs:{self.seed}")
            return [self.source.preference_pair(rng, held_out=True) for _ in range(n)]
        return self.held_out[:n]

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn, "pairs": self._name(), "reference": self.reference}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the pairs `state` counts. Raises ConfigError for another source's."""
        if state.get("pairs") != self._name():
            raise ConfigError(
                f"the checkpoint's preference pairs are {state.get('pairs')}, this run's are "
                f"{self._name()}; resume with the same rl.task / rl.data_path"
            )
        check_reference(state, self.reference)
        self.drawn = int(state["drawn"])

    def _name(self) -> str:
        if isinstance(self.source, DigitTask):
            return f"{self.source.kind}-{self.source.digits}"
        return f"jsonl-{len(self.source)}"
