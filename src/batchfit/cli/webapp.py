"""batchfit's web app: the command line's answers from a form (``batchfit ui``).

A page built with Gradio (``pip install 'batchfit[ui]'``), deployable as a Hugging Face
Space (``app.py`` at the repository's root). The form's fields are translated into the
words of a ``batchfit estimate`` (a batch size given) or ``batchfit max`` command, and that
command runs as its own process with ``--json``:

* the answer is the command line's, by construction (the same words, the same code);
* its progress lines (stderr, one per trace) show under the form while it runs;
* Cancel ends the process, so a long trace stops at once and nothing is left running;
* bad input gets the command's own one-line message.

The form itself never decides anything that changes an answer: empty fields are left out
of the command, so the library's defaults apply.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from batchfit.cli.common import err
from batchfit.cli.root import app

#: Choices offered where the command takes a fixed set (the command checks them again).
MODES = ("train", "infer")
PRECISIONS = ("", "fp32", "tf32", "amp-fp16", "amp-bf16", "bf16", "fp16")
OPTIMIZERS = ("", "adamw", "adam", "sgd", "momentum", "nesterov", "adagrad", "rmsprop",
              "adafactor", "lion", "adamw8bit", "paged-adamw8bit")
QUANTS = ("", "nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
STRATEGIES = ("", "ddp", "fsdp", "fsdp-grad-op", "hsdp", "fsdp1", "zero1", "zero2", "zero3", "tp")


@dataclass(frozen=True)
class Request:
    """What the form asks, in the command line's vocabulary (empty: leave it out)."""

    model: str = ""
    model_file: str = ""  # an uploaded .py file, with ``factory`` naming its builder
    factory: str = ""
    gpu: str = ""
    memory: str = ""
    mode: str = "train"
    precision: str = ""
    optimizer: str = ""
    batch_size: int = 0  # 0: find the largest batch
    seq_len: int = 0
    input_shape: str = ""
    lora: str = ""
    quant: str = ""
    world_size: int = 0
    strategy: str = ""


@dataclass(frozen=True)
class Answer:
    """One run of the command: its exit code, its JSON (when it printed one), its last
    line on stderr, and the text the page shows."""

    exit_code: int
    data: dict[str, Any] | None
    message: str
    summary: str


def command_words(request: Request) -> list[str]:
    """The ``batchfit`` words for ``request`` (without the program name).

    Raises:
        ValueError: neither a model name nor a model file was given.
    """
    model = request.model.strip()
    if request.model_file:
        factory = request.factory.strip() or "build"
        model = f"{request.model_file}:{factory}"
    if not model:
        raise ValueError("give a model: timm:NAME, torchvision:NAME, hf:ORG/NAME, or upload a "
                         "file.py with a factory")
    words = ["estimate", model, "--batch-size", str(int(request.batch_size))] \
        if request.batch_size else ["max", model]
    for flag, value in (("--gpu", request.gpu), ("--memory", request.memory),
                        ("--precision", request.precision), ("--optimizer", request.optimizer),
                        ("--input", request.input_shape), ("--lora", request.lora),
                        ("--quant", request.quant), ("--strategy", request.strategy)):
        if value and str(value).strip():
            words += [flag, str(value).strip()]
    if request.mode and request.mode != "train":
        words += ["--mode", request.mode]
    if request.seq_len:
        words += ["--seq-len", str(int(request.seq_len))]
    if request.world_size:
        words += ["--world-size", str(int(request.world_size))]
    if words[0] == "max" and not request.gpu:  # the budget: a card, or memory on the CPU
        if not request.memory.strip():
            raise ValueError("give a GPU, or a memory size as the CPU's budget")
        words += ["--device", "cpu"]
    return [*words, "--json"]


@dataclass(frozen=True)
class OutputFiles:
    """The files a request asks the command to write beside its answer."""

    paths: dict[str, Path]

    @property
    def flags(self) -> list[str]:
        names = {"report": "--html", "snapshot": "--export-snapshot"}
        return [word for kind, path in self.paths.items() for word in (names[kind], str(path))]

    def existing(self, kind: str) -> str | None:
        path = self.paths.get(kind)
        return str(path) if path is not None and path.is_file() else None


def output_files(words: Sequence[str], folder: Path) -> OutputFiles:
    """The report for every answer, and the predicted snapshot for a GPU's (``--gpu``)."""
    paths = {"report": folder / "batchfit-report.html"}
    if "--gpu" in words:
        paths["snapshot"] = folder / "batchfit-step.pickle"
    return OutputFiles(paths)


class Running:
    """The commands running now, each under the key of the browser session that asked.

    Cancel ends its session's command here, at once: Gradio's cancel stops the request's
    generator only when it next yields, and a command between two progress lines (a long
    trace) yields nothing until its next line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: dict[str, subprocess.Popen] = {}

    def add(self, key: str, process: subprocess.Popen) -> None:
        with self._lock:
            self._processes[key] = process

    def remove(self, key: str, process: subprocess.Popen) -> None:
        with self._lock:
            if self._processes.get(key) is process:
                del self._processes[key]

    def stop(self, key: str) -> bool:
        """End ``key``'s command; False when none was running."""
        with self._lock:
            process = self._processes.pop(key, None)
        if process is None or process.poll() is not None:
            return False
        process.kill()
        process.wait()
        return True


def run(words: Sequence[str], env: dict[str, str] | None = None,
        running: tuple[Running, str] | None = None) -> Iterator[str | Answer]:
    """Run ``batchfit WORDS`` as its own process: yields each progress line it writes on
    stderr, then the :class:`Answer`. Closing the generator (a cancelled request) ends the
    process; so does ``Running.stop(key)`` with ``running=(Running, key)``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "batchfit.cli", *words], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    if running is not None:
        running[0].add(running[1], process)
    last = ""
    try:
        assert process.stderr is not None and process.stdout is not None
        for line in process.stderr:
            line = line.rstrip()
            if line:
                last = line
                yield line
        output = process.stdout.read()
        code = process.wait()
    finally:
        if running is not None:
            running[0].remove(running[1], process)
        if process.poll() is None:  # cancelled: stop the trace now
            process.kill()
            process.wait()
    try:
        data = json.loads(output) if output.strip() else None
    except ValueError:
        data = None
    yield Answer(code, data, last, summarize(words[0], code, data, last))


def summarize(command: str, exit_code: int, data: dict[str, Any] | None, message: str) -> str:
    """The answer in one or two lines of Markdown."""
    from batchfit.cli.report import format_bytes

    if data is None:
        return f"**Error** (exit {exit_code}): {message or 'the command printed nothing'}"
    device = data.get("device", {}).get("name", "")
    if command == "max":
        if exit_code == 3 or not data.get("max_batch_size"):
            return f"**Nothing fits** on {device}: {message}"
        needed = data.get("total_bytes_at_max")
        return (f"Largest batch: **{data['max_batch_size']}** on {device} "
                f"({format_bytes(needed)} = {needed:,} bytes needed; binding constraint: "
                f"{data.get('binding_constraint', 'memory')})")
    total = data.get("total_bytes", 0)
    return (f"Peak memory at batch {data.get('batch_size')}: **{format_bytes(total)}** "
            f"({total:,} bytes) on {device} (peak in {data.get('peak_phase', '?')})")


def gpu_names() -> list[str]:
    """The catalog's cards, for the form's list."""
    from batchfit.device.catalog import list_gpus

    return [card.name for card in list_gpus()]


def build_app() -> Any:
    """The Gradio page (not launched)."""
    try:
        import gradio as gr
    except ImportError as exc:  # pragma: no cover - the ui extra
        raise ImportError("batchfit ui needs Gradio: pip install 'batchfit[ui]'") from exc

    with gr.Blocks(title="batchfit") as page:
        gr.Markdown("# batchfit\nHow much GPU memory will this step take, and what is the "
                    "largest batch that fits? Predicted from the model itself, no GPU needed.")
        with gr.Row():
            model = gr.Textbox(label="Model", placeholder="timm:resnet50, hf:ORG/NAME, ...",
                               elem_id="model")
            model_file = gr.File(label="or a model file (.py)", file_types=[".py"],
                                 elem_id="model-file")
            factory = gr.Textbox(label="its factory", value="build", elem_id="factory")
        with gr.Row():
            gpu = gr.Dropdown(choices=["", *gpu_names()], value="", label="GPU",
                              allow_custom_value=True, elem_id="gpu")
            memory = gr.Textbox(label="Memory (e.g. 48GiB)", elem_id="memory")
            mode = gr.Radio(list(MODES), value="train", label="Mode", elem_id="mode")
            batch = gr.Number(value=0, precision=0, label="Batch size (0: the largest)",
                              elem_id="batch")
        with gr.Accordion("Step", open=False):
            with gr.Row():
                precision = gr.Dropdown(list(PRECISIONS), value="", label="Precision",
                                        elem_id="precision")
                optimizer = gr.Dropdown(list(OPTIMIZERS), value="", label="Optimizer",
                                        elem_id="optimizer")
                seq_len = gr.Number(value=0, precision=0, label="Sequence length (0: default)",
                                    elem_id="seq-len")
                input_shape = gr.Textbox(label="Input per sample (e.g. 3x224x224)",
                                         elem_id="input")
        with gr.Accordion("LLM fine-tuning and multi-GPU", open=False):
            with gr.Row():
                lora = gr.Textbox(label="LoRA (e.g. r=16,alpha=32,targets=all-linear)",
                                  elem_id="lora")
                quant = gr.Dropdown(list(QUANTS), value="", label="Quantized base (QLoRA)",
                                    elem_id="quant")
                world = gr.Number(value=0, precision=0, label="GPUs (0: one)", elem_id="world")
                strategy = gr.Dropdown(list(STRATEGIES), value="", label="Strategy",
                                       elem_id="strategy")
        with gr.Row():
            go = gr.Button("Answer", variant="primary", elem_id="run")
            stop = gr.Button("Cancel", elem_id="cancel")
        status = gr.Textbox(label="Progress", interactive=False, elem_id="status")
        answer = gr.Markdown(elem_id="answer")
        with gr.Row():
            report = gr.File(label="Interactive report (HTML)", elem_id="report")
            snapshot = gr.File(label="Predicted memory snapshot (for pytorch.org/memory_viz)",
                               elem_id="snapshot")
        details = gr.JSON(label="The answer's JSON", elem_id="json")

        running = Running()
        names = ("model", "model_file", "factory", "gpu", "memory", "mode", "batch_size",
                 "precision", "optimizer", "seq_len", "input_shape", "lora", "quant",
                 "world_size", "strategy")

        def answer_request(request: gr.Request, *values: Any) -> Iterator[tuple[str, str, Any]]:
            fields = dict(zip(names, values))
            upload = fields["model_file"]
            fields["model_file"] = getattr(upload, "name", upload) or ""
            fields = {k: ("" if v is None else v) for k, v in fields.items()}
            for key in ("batch_size", "seq_len", "world_size"):
                fields[key] = int(fields[key] or 0)
            try:
                words = command_words(Request(**fields))
            except ValueError as exc:
                yield "", f"**Error:** {exc}", None, None, None
                return
            command = shlex.join(["batchfit", *words[:-1]])  # to paste into a shell
            yield command, "", None, None, None
            folder = Path(tempfile.mkdtemp(prefix="batchfit-ui-"))
            files = output_files(words, folder)
            for item in run([*words[:-1], *files.flags, "--json"],
                            running=(running, request.session_hash)):
                if isinstance(item, Answer):
                    # done: the command that answered, not its last progress line
                    status = f"done: {command}" if item.exit_code == 0 else item.message
                    yield (status, item.summary, item.data, files.existing("report"),
                           files.existing("snapshot"))
                else:
                    yield item, "", None, None, None

        inputs = [model, model_file, factory, gpu, memory, mode, batch, precision, optimizer,
                  seq_len, input_shape, lora, quant, world, strategy]
        event = go.click(answer_request, inputs, [status, answer, details, report, snapshot])
        def cancel(request: gr.Request) -> None:
            running.stop(request.session_hash)

        # Gradio finds the request parameter by its annotation, resolved at run time; this
        # module's annotations are strings that name a local import, so give the class
        for handler in (answer_request, cancel):
            handler.__annotations__["request"] = gr.Request
        stop.click(cancel, None, None, cancels=[event])
    return page


@app.command("ui")
def ui_cmd(
    host: str = typer.Option("127.0.0.1", "--host", help="the address to serve on"),
    port: int = typer.Option(7860, "--port", help="the port to serve on"),
) -> None:
    """Serve the web app: the answers of estimate and max from a form (batchfit[ui])."""
    try:
        page = build_app()
    except ImportError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    page.queue().launch(server_name=host, server_port=port)  # pragma: no cover - serves
