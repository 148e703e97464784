"""The kit's configurations: what each boundary row runs, and the tiny ones of the dry run.

A :class:`Config` is one step as a user would describe it to ``batchfit max``: the model
spec (``timm:``, ``torchvision:``, ``hf:`` from the offline table, so nothing is
downloaded on the card), its input, mode, precision, layout, optimizer, the
``cudnn.benchmark`` and ``inference_mode`` flags, and the allocator cap in GiB that
emulates a smaller card's budget. :meth:`Config.max_argv` is the exact ``batchfit max``
command whose answer is the row's ``predicted``; :meth:`Config.trial_setup` is the same
step for a real trial, resolved through :func:`batchfit.models.resolve.resolve_model`
and the CLI's own config builder, so prediction and trial cannot drift apart.

Caps are chosen so each boundary stays small in wall time: big models (EVA02-L,
BiT-R101x3, TinyLlama) at caps where the batch is tens, not thousands.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
#: The card the predictions are for, as the catalog names it (nvidia-smi's name for the
#: lent H100: "NVIDIA H100 80GB HBM3", an alias of the H100 SXM5 row).
PREDICT_GPU = "NVIDIA H100 80GB HBM3"
#: The stack the device runs (torch 2.11.0+cu130, KINDS.md).
PREDICT_STACK = "torch2.11+cu130"


@dataclass(frozen=True)
class Config:
    """One boundary row's step (see the module docstring).

    ``cap_mib``: the allocator cap (``set_per_process_memory_fraction(cap / total)`` on a
    card; ``RLIMIT_DATA`` above the warmed-up state in the dry run). ``note`` says why the
    row is in the list (a user report it re-creates, a mechanism it exercises).
    """

    model: str
    input: str  # "3x224x224", or "seq1024" for a token model
    mode: str = "train"
    precision: str = "amp-fp16"
    layout: str = "nchw"  # or "nhwc" (channels-last)
    optimizer: str = "adamw"
    cudnn_benchmark: bool = False
    inference_mode: bool = False
    cap_mib: int = 8 * 1024
    model_kwargs: tuple[str, ...] = ()  # "key=value", as --model-kwargs takes them
    note: str = ""

    @property
    def key(self) -> str:
        flags = ("-bench" if self.cudnn_benchmark else "") + ("-infmode" if self.inference_mode
                                                              else "")
        optimizer = self.optimizer if self.mode == "train" else "-"
        model = ",".join((self.model, *self.model_kwargs))
        return (f"{model}|{self.input}|{self.mode}|{self.precision}|{self.layout}|"
                f"{optimizer}{flags}|{self.cap_mib}MiB")

    @property
    def cap_bytes(self) -> int:
        return self.cap_mib * MiB

    def input_args(self) -> list[str]:
        if self.input.startswith("seq"):
            return ["--seq-len", self.input[3:]]
        return ["--input", self.input]

    def step_args(self) -> list[str]:
        """The step's options, as ``batchfit max``/``search``/``estimate`` take them."""
        args = [self.model, *self.input_args(), "--mode", self.mode, "--precision",
                self.precision]
        if self.mode == "train":
            args += ["--optimizer", self.optimizer]
        for item in self.model_kwargs:
            args += ["--model-kwargs", item]
        if self.layout == "nhwc":
            args.append("--channels-last")
        if self.inference_mode:
            args.append("--inference-mode")
        return args

    def max_argv(self, gpu: str | None = PREDICT_GPU, stack: str | None = PREDICT_STACK
                 ) -> list[str]:
        """``batchfit max`` for the cap alone: the card's architecture with ``cap`` of
        memory and no CUDA context (``--overhead 0``: the cap limits the allocator, the
        context lies outside it), on ``stack``. ``gpu=None``: the dry run's CPU budget."""
        args = ["max", *self.step_args(), "--memory", f"{self.cap_mib}MiB", "--overhead", "0",
                "--json"]
        if gpu is not None:
            args += ["--gpu", gpu, "--stack", stack]
            if self.cudnn_benchmark:
                args.append("--cudnn-benchmark")
        else:
            args += ["--device", "cpu"]
        return args

    def estimate_argv(self, batch_size: int, snapshot: str) -> list[str]:
        """``batchfit estimate`` of this step on the predicted card and cap, set against a
        snapshot recorded on the device (the snapshot diff, run on the CPU)."""
        args = ["estimate", *self.step_args(), "--batch-size", str(batch_size), "--gpu",
                PREDICT_GPU, "--memory", f"{self.cap_mib}MiB", "--overhead", "0", "--stack",
                PREDICT_STACK, "--snapshot", snapshot, "--json"]
        return args + (["--cudnn-benchmark"] if self.cudnn_benchmark else [])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """The inverse of :meth:`to_dict` (a snapshot's record)."""
        fields = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        fields["model_kwargs"] = tuple(fields.get("model_kwargs", ()))
        return cls(**fields)

    def trial_setup(self) -> tuple[Any, Any, Any]:
        """``(factory, inputs, TrainConfig)`` of the real step, as the CLI builds them."""
        from batchfit.api.step import resolve_step, stack_settings

        seq_len = int(self.input[3:]) if self.input.startswith("seq") else None
        shape = None if seq_len is not None else self.input
        settings = stack_settings(cudnn_benchmark=self.cudnn_benchmark,
                                  inference_mode=self.inference_mode)
        step = resolve_step(
            self.model, input_shape=shape, seq_len=seq_len, mode=self.mode,
            optimizer=self.optimizer if self.mode == "train" else None,
            precision=self.precision, channels_last=self.layout == "nhwc",
            model_kwargs=list(self.model_kwargs), **settings)
        return step.spec.factory, step.inputs, step.config

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "key": self.key}


def _c(model: str, input: str, cap_gib: float, **kw: Any) -> Config:
    return Config(model, input, cap_mib=int(cap_gib * 1024), **kw)


T, I = "train", "infer"
#: The boundary rows (>= 40), in the order the kit runs them.
CONFIGS: tuple[Config, ...] = (
    # timm CNNs
    _c("timm:resnet50", "3x224x224", 8),
    _c("timm:resnet50", "3x224x224", 8, layout="nhwc", cudnn_benchmark=True),
    _c("timm:resnet50", "3x224x224", 12, precision="amp-bf16", layout="nhwc", optimizer="sgd"),
    _c("timm:resnet50", "3x224x224", 8, mode=I, layout="nhwc", cudnn_benchmark=True,
       inference_mode=True),
    _c("timm:resnet50", "3x224x224", 8, mode=I, precision="fp32"),
    _c("timm:resnet50", "3x224x224", 40, precision="fp32", cudnn_benchmark=True),
    _c("timm:resnet152", "3x224x224", 16, precision="amp-bf16", cudnn_benchmark=True),
    _c("timm:resnext50_32x4d", "3x224x224", 12, layout="nhwc", cudnn_benchmark=True),
    _c("timm:efficientnet_b3", "3x288x288", 16),
    _c("timm:regnety_032", "3x224x224", 12, precision="amp-bf16", layout="nhwc",
       cudnn_benchmark=True),
    _c("timm:densenet121", "3x224x224", 12),
    _c("timm:seresnext50_32x4d", "3x224x224", 12, cudnn_benchmark=True, optimizer="nesterov"),
    # ConvNeXt (the snapshot row: ConvNeXt-T at 384)
    _c("timm:convnext_tiny", "3x384x384", 16, layout="nhwc", cudnn_benchmark=True),
    _c("timm:convnext_tiny", "3x384x384", 8, layout="nhwc", cudnn_benchmark=True),
    _c("timm:convnext_tiny", "3x384x384", 16, precision="amp-bf16"),
    _c("timm:convnext_tiny", "3x384x384", 8, mode=I, layout="nhwc", cudnn_benchmark=True,
       inference_mode=True),
    _c("timm:convnext_base", "3x224x224", 24, precision="amp-bf16", layout="nhwc"),
    # ViTs
    _c("timm:vit_base_patch16_224", "3x224x224", 16),
    _c("timm:vit_base_patch16_224", "3x224x224", 12, precision="amp-bf16"),
    _c("timm:vit_base_patch16_224", "3x224x224", 8, mode=I, precision="amp-bf16",
       inference_mode=True),
    _c("timm:vit_large_patch16_224", "3x224x224", 24, precision="amp-bf16"),
    _c("timm:deit_small_patch16_224", "3x224x224", 8),
    _c("timm:swin_tiny_patch4_window7_224", "3x224x224", 12),
    # BiT ResNetV2 (a snapshot row)
    _c("timm:resnetv2_101x3_bit", "3x224x224", 24, cudnn_benchmark=True),
    _c("timm:resnetv2_101x3_bit", "3x448x448", 16, mode=I, cudnn_benchmark=True,
       inference_mode=True),
    # EVA02-L (a snapshot row)
    _c("timm:eva02_large_patch14_448", "3x448x448", 40, precision="amp-bf16"),
    _c("timm:eva02_large_patch14_448", "3x448x448", 8, mode=I, inference_mode=True),
    # deep squeeze-and-excitation ResNets at 256 px (a snapshot row), and the two user
    # reports of issue 39 re-created on this card (same model, mode, precision and flags;
    # the cap is their card's 24 GiB less a lazy context)
    _c("timm:seresnet152d", "3x256x256", 23.5, cudnn_benchmark=True, optimizer="nesterov",
       note="user report: RTX 3090, answered 143, failed at 128"),
    _c("timm:seresnet152d", "3x256x256", 12, cudnn_benchmark=True, optimizer="nesterov"),
    _c("timm:seresnet152d", "3x256x256", 8, mode=I, cudnn_benchmark=True, inference_mode=True),
    _c("timm:lambda_resnet26rpt_256", "3x256x256", 23.5, mode=I, cudnn_benchmark=True,
       inference_mode=True, note="user report: RTX 4090, answered 1040, failed at 768"),
    # torchvision: depthwise + squeeze-and-excitation
    _c("torchvision:mobilenet_v3_large", "3x224x224", 8),
    _c("torchvision:mobilenet_v3_large", "3x224x224", 8, mode=I, layout="nhwc",
       cudnn_benchmark=True, inference_mode=True),
    _c("torchvision:efficientnet_b0", "3x224x224", 8, precision="amp-bf16",
       cudnn_benchmark=True),
    _c("torchvision:efficientnet_b0", "3x224x224", 8, layout="nhwc"),
    # Hugging Face, built from the offline config table
    _c("hf:openai-community/gpt2", "seq1024", 16, precision="amp-bf16"),
    _c("hf:openai-community/gpt2", "seq1024", 16),
    _c("hf:openai-community/gpt2", "seq1024", 8, mode=I, precision="amp-bf16",
       inference_mode=True),
    _c("hf:google-bert/bert-base-uncased", "seq512", 16),
    _c("hf:google-bert/bert-base-uncased", "seq512", 8, mode=I, precision="amp-bf16"),
    _c("hf:google-bert/bert-large-uncased", "seq512", 24, precision="amp-bf16"),
    _c("hf:TinyLlama/TinyLlama-1.1B-Chat-v1.0", "seq1024", 40, precision="amp-bf16"),
    _c("hf:TinyLlama/TinyLlama-1.1B-Chat-v1.0", "seq2048", 8, mode=I, precision="amp-bf16",
       inference_mode=True),
)

#: The rows whose steady step at the boundary is recorded as a memory snapshot (part 3).
SNAPSHOT_KEYS: tuple[str, ...] = (
    CONFIGS[12].key,  # convnext_tiny 384, 16 GiB
    CONFIGS[23].key,  # resnetv2_101x3_bit
    CONFIGS[25].key,  # eva02_large_patch14_448, training
    CONFIGS[27].key,  # seresnet152d 256, the user report's step
)

#: The dry run's rows: tiny models under a CPU cap (``RLIMIT_DATA``), seconds each.
DRY_CONFIGS: tuple[Config, ...] = (
    Config("torchvision:mobilenet_v3_small", "3x32x32", precision="fp32", optimizer="sgd",
           cap_mib=192),
    Config("torchvision:mobilenet_v3_small", "3x32x32", mode=I, precision="fp32",
           inference_mode=True, cap_mib=96),
    Config("hf:openai-community/gpt2", "seq32", precision="fp32", optimizer="sgd", cap_mib=128,
           model_kwargs=("n_layer=1", "n_embd=64", "n_head=2")),
)
DRY_SNAPSHOT_KEYS: tuple[str, ...] = (DRY_CONFIGS[2].key,)


def configs_for(dry_run: bool) -> tuple[Config, ...]:
    return DRY_CONFIGS if dry_run else CONFIGS


def snapshot_keys_for(dry_run: bool) -> tuple[str, ...]:
    return DRY_SNAPSHOT_KEYS if dry_run else SNAPSHOT_KEYS
