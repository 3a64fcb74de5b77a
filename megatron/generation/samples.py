"""generate.py's three ways to sample a model, with GPT-NeoX's settings and output.

- unconditional: `num_samples` completions of an empty prompt (the end-of-document token);
- input-file: one completion of each prompt of `sample_input_file`, the prompts separated by
  `prompt_end`, each stripped of surrounding white space, empty ones skipped;
- interactive: prompts typed on global rank 0's standard input (ended by `prompt_end`; an end of
  input ends the session), each completion printed.

The first two write `sample_output_file` (for input-file without one: `<sample_input_file>.output.jsonl`)
as GPT-NeoX writes it: one JSON object a line, with `context` (the prompt), `text` (the completion),
`length` (its tokens), `finished` (ended by the end-of-document token), `message` and
`duration_seconds`. Every rank generates; global rank 0 writes.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.generation.completion import Limits, complete
from megatron.generation.errors import GenerationError
from megatron.generation.sampling import Sampling
from megatron.hf.output_folder import check_output_apart

INTERACTIVE_PROMPT = "Context prompt >>> "


@dataclass(frozen=True)
class GenerationSettings:
    """The settings generate.py's sampling reads (each field the setting of that name; `sampling` holds temperature,
    top_k and top_p), built once from the run's settings by generate_samples."""

    text_gen_type: str | None
    seq_length: int
    maximum_tokens: int
    recompute: bool
    prompt_end: str
    num_samples: int
    sample_input_file: str | None
    sample_output_file: str | None
    sampling: Sampling

    @classmethod
    def from_args(cls, args) -> GenerationSettings:
        return cls(args.text_gen_type, args.seq_length, args.maximum_tokens, args.recompute, args.prompt_end,
                   args.num_samples, args.sample_input_file, args.sample_output_file, Sampling.of(args))


def check_generation_settings(args) -> None:
    """What generate.py cannot run with, before any model is built."""
    if args.text_gen_type is None:
        raise GenerationError("text_gen_type: not set; set it to unconditional, input-file, interactive or "
                              "precompute (e.g. add configs/text_generation.yml)")
    if args.text_gen_type == "precompute" and not args.precompute_model_name:
        raise GenerationError("precompute_model_name: not set, and text_gen_type is precompute; set it to the name "
                              "of the files to write ({data path}_{name}.bin/.idx)")
    if not args.load:
        raise GenerationError("load: not set; generate.py samples a trained model: set `load` to its checkpoint "
                              "directory (or a Hugging Face model folder)")
    if args.text_gen_type == "input-file":
        if not args.sample_input_file:
            raise GenerationError("sample_input_file: not set, and text_gen_type is input-file; set it to a file "
                                  "of prompts separated by prompt_end")
        if not Path(args.sample_input_file).is_file():
            raise GenerationError(f"sample_input_file: {args.sample_input_file!r} is not a file; set it to a file "
                                  "of prompts separated by prompt_end")
    output = output_file(args.text_gen_type, args.sample_input_file, args.sample_output_file)
    if output:
        check_output_apart(output, [args.sample_input_file, args.load], "sample_output_file", GenerationError)


def output_file(text_gen_type: str | None, sample_input_file: str | None, sample_output_file: str | None) -> str | None:
    """The file generate.py writes its samples to (none for interactive and precompute)."""
    if text_gen_type == "unconditional":
        return sample_output_file
    if text_gen_type == "input-file":
        return sample_output_file or f"{sample_input_file}.output.jsonl"
    return None


def read_prompts(path: str, prompt_end: str) -> list[str]:
    text = Path(path).read_text(encoding="utf-8")
    return [prompt.strip() for prompt in text.split(prompt_end) if prompt.strip()]


def sample(model, tokenizer, settings: GenerationSettings, text: str) -> dict[str, Any]:
    """GPT-NeoX's record of one completion of `text`."""
    started = time.perf_counter()
    prompt = tokenizer.tokenize(text) if text else [tokenizer.eod]
    limits = Limits(settings.seq_length, settings.maximum_tokens, tokenizer.eod)
    record: dict[str, Any] = {"context": text, "text": None, "length": 0, "finished": False, "message": None}
    if len(prompt) >= settings.seq_length:
        record["message"] = (f"the prompt has {len(prompt)} tokens, which leaves no room within seq_length="
                             f"{settings.seq_length}; shorten it")
    else:
        completion = complete(model, prompt, limits, settings.sampling, recompute=settings.recompute)
        unknown = [token for token in completion.tokens if token >= tokenizer.vocab_size]
        record.update(length=len(completion.tokens), finished=completion.finished)
        if unknown:
            record["message"] = (f"generated token id {unknown[0]}, a padding row of the embedding the tokenizer "
                                 f"({tokenizer.vocab_size} tokens) has no text for")
        else:
            record["text"] = tokenizer.detokenize(completion.tokens)
    record["duration_seconds"] = time.perf_counter() - started
    return record


def _write(records: list[dict[str, Any]], path: str, rank: int) -> None:
    if rank != 0:
        return
    out = Path(path)
    if out.parent != Path():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")


def _read_interactive_prompt(prompt_end: str) -> str | None:
    """One prompt from standard input, ended by `prompt_end`; None at the end of input."""
    lines: list[str] = []
    while True:
        try:
            line = input(INTERACTIVE_PROMPT if not lines else "")
        except EOFError:
            return "\n".join(lines) if lines else None
        if prompt_end == "\n":
            return line
        if prompt_end in line:
            lines.append(line.split(prompt_end)[0])
            return "\n".join(lines)
        lines.append(line)


def _interactive(model, tokenizer, settings: GenerationSettings, rank: int, log) -> int:
    from megatron.runtime.collective import decided_by_rank_zero

    count = 0
    while True:
        prompt = decided_by_rank_zero(_read_interactive_prompt(settings.prompt_end) if rank == 0 else None)
        if prompt is None:
            return count
        record = sample(model, tokenizer, settings, prompt)
        if rank == 0:
            print("Generated Text: " + (record["text"] if record["text"] is not None else record["message"]),
                  file=sys.stdout, flush=True)
        count += 1


def generate_samples(model, tokenizer, args, rank: int, log) -> list[dict[str, Any]]:
    """Run `args.text_gen_type` on `model`; the records written (none for interactive)."""
    if args.text_gen_type == "precompute":
        from megatron.checkpointing import LoadSettings
        from megatron.generation.precompute import write_reference_log_probs
        from megatron.hf import HF_FOLDER
        from megatron.objectives.precomputed_reference import PrecomputeSettings, identity_of_load
        from megatron.ranks import data_parallel_rank_and_size

        identity = identity_of_load(LoadSettings.from_args(args), data_parallel_rank_and_size()[1], HF_FOLDER)
        write_reference_log_probs(model, PrecomputeSettings.from_args(args), identity, rank, log)
        return []
    settings = GenerationSettings.from_args(args)
    if settings.text_gen_type == "interactive":
        log.info(f"interactive generation ended after {_interactive(model, tokenizer, settings, rank, log)} prompt(s)")
        return []
    if settings.text_gen_type == "unconditional":
        prompts = [""] * settings.num_samples
    else:
        prompts = read_prompts(settings.sample_input_file, settings.prompt_end)
    output = output_file(settings.text_gen_type, settings.sample_input_file, settings.sample_output_file)
    log.info(f"generating {len(prompts)} sample(s) ({settings.text_gen_type}); writing them to {output}")
    records = [sample(model, tokenizer, settings, text) for text in prompts]
    if output:
        _write(records, output, rank)
    log.info(f"wrote {len(records)} sample(s) to {output}")
    return records
