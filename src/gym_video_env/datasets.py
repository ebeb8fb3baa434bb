"""Video-QA datasets as Gym rows: ``convert`` from common formats, ``validate``, ``generate``.

``python -m gym_video_env.datasets convert --format FORMAT INPUT OUTPUT --media-root DIR``
    Writes one Gym row per record (the ``video_mcqa`` row shape: ``responses_create_params`` with
    an ``input_video`` part and the question, ``options``, ``answer``). Formats:

    - ``video-r1``: a JSON list of Video-R1 records (``problem``, ``options`` as ``["A. text", ...]``,
      ``solution`` as ``<answer>B</answer>``, ``path``; records whose ``data_type`` is not
      ``video`` are errors);
    - ``nextqa``: NExT-QA CSV, or JSONL with the same keys (``video``, ``question``, ``a0``..``a4``,
      ``answer`` as the index of the correct option, ``qid``); the video file is
      ``--video-template`` (default ``{video}.mp4``) filled in with the record's fields;
    - ``generic``: JSONL, one object per line with ``video``, ``prompt`` (or ``question``) and
      ``answer``, optionally ``options`` (a ``{letter: text}`` object or a list of texts, lettered
      A, B...) and ``id``; other keys are ignored. ``video-grpo make-clips`` writes this format
      (see :data:`GENERIC_FORMAT_HELP`).

    Video paths are written relative to the media root (relative input paths are taken relative
    to it too); a video outside the media root is an error.

``python -m gym_video_env.datasets validate ROWS --media-root DIR [--no-decode] [limits]``
    Checks every row: its shape (messages, tool calls and tool outputs; content parts of known
    types), each media part (in a message or a tool output: confined to the media root, within
    ``--max-video-bytes``, and, unless ``--no-decode``, that it decodes: a video's frames at
    :data:`VALIDATE_FRAMES` points spread over it, every frame a cached-frame manifest names, an
    image), and that ``answer`` is one of the ``options`` letters. Decoding uses the resource
    bounds of :class:`vllm_video_plugin.decode.DecodeLimits`, set with ``--max-frame-pixels``,
    ``--max-frames`` and ``--decode-timeout-s`` (``--max-video-bytes`` also bounds decoding).

``python -m gym_video_env.datasets generate NAME OUTPUT --media-root DIR``
    Writes clips under the media root and their rows with the row generator registered as ``NAME``
    in the ``gym_video_env.row_generators`` entry point group (video-grpo's demo registers
    ``video_mcqa`` and ``video_segments``; see :func:`gym_video_env.environments.row_generator`).

``convert`` and ``validate`` report every bad record with its line number (the 1-based line of
the input file; for a JSON list, the 1-based record number) and its reason, and exit with status
1 when there was any: a bad record is never dropped silently. ``convert`` still writes the good
ones. Both show a progress bar on stderr.
"""

from __future__ import annotations

import argparse
import base64
import csv
import dataclasses
import io
import json
import re
import sys
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final, TextIO

from PIL import Image
from tqdm import tqdm

from gym_video_env.environments import ROW_GENERATORS_GROUP, row_generator, write_rows_jsonl
from gym_video_env.grading import BOXED_INSTRUCTION
from gym_video_env.handlers import MEDIA_PART_TYPES, VIDEO_PART_TYPE, media_ref, resolve_local_media
from gym_video_env.hookspecs import MediaError, MediaSettings
from gym_video_env.plugins import get_plugin_manager
from vllm_video_plugin.contract import VideoSamplingContract
from vllm_video_plugin.decode import DEFAULT_LIMITS, DecodeLimits, decode_frames
from vllm_video_plugin.errors import VideoDecodeError, VideoGRPOError
from vllm_video_plugin.manifest import ManifestError, load_manifest_frames, sniff_media

__all__ = [
    "FORMATS",
    "GENERIC_FORMAT_HELP",
    "KNOWN_PART_TYPES",
    "VALIDATE_FRAMES",
    "DatasetFileError",
    "RowError",
    "convert_records",
    "main",
    "read_records",
    "validate_row",
    "validate_rows",
]

FORMATS: Final = ("video-r1", "nextqa", "generic")
GENERIC_FORMAT_HELP: Final = """\
input formats:
  video-r1  a JSON list of Video-R1 records: problem, options ["A. text", ...],
            solution "<answer>B</answer>", path, data_type "video"
  nextqa    NExT-QA CSV (or JSONL with the same keys): video, question, a0..a4,
            answer (index of the correct option), qid; the file is --video-template
  generic   JSONL, one object per line:
              video     path of the clip: relative to --media-root, or absolute
                        (or file://) inside it; data: and http(s):// URLs pass as is
              prompt    the question (`question` is accepted instead)
              answer    the correct option's letter (or the expected answer text
                        when there are no options)
              options   optional: {"A": "text", ...} or ["text", ...] (lettered A, B...)
              id        optional: the row's task_id (default: generic-LINE)
            other keys are ignored. `video-grpo make-clips OUT --media-root ROOT`
            writes this format, video paths relative to ROOT.
  example   {"video": "clips/a.mp4", "prompt": "What colour is shown?",
             "options": ["red", "green"], "answer": "B", "id": "a"}

Each row holds the question (with options: lettered, then the \\boxed{} instruction),
options, answer and task_id, the video relative to --media-root. A bad record is reported
as FILE:LINE: reason (exit status 1); the good ones are still written.
"""
"""The ``convert --help`` text describing the input formats."""
KNOWN_PART_TYPES: Final = frozenset(
    {"input_text", "input_image", "input_video", "input_file", "input_audio", "output_text", "refusal"}
)
"""Content part types a row's messages and tool outputs may hold (Responses API types, plus
``input_video``); anything else is reported."""
VALIDATE_FRAMES: Final = 8
"""Frames the validator decodes per video, spread uniformly over it (all of a shorter video)."""
_VALIDATE_CONTRACT: Final = VideoSamplingContract(style="uniform", num_frames=VALIDATE_FRAMES)
_EVERY_FRAME: Final = VideoSamplingContract(style="uniform")
_LETTERS: Final = "ABCDEFGHIJ"
_VIDEO_R1_OPTION = re.compile(r"^\s*\(?([A-Z])[.):]\s*(.*)$", re.DOTALL)
_VIDEO_R1_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)


class DatasetFileError(ValueError):
    """An input file that is not what its format says (a Video-R1 file that is not a JSON list)."""


@dataclass(frozen=True)
class RowError:
    """One bad record: where it is and why it is bad."""

    line: int
    """1-based line of the input file (for a JSON list: 1-based record number)."""
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


# --- reading ---------------------------------------------------------------------------------------


def read_records(path: Path, fmt: str) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """``(line, record)`` for each record of ``path`` in format ``fmt``; unparsable ones as :class:`RowError`.

    A ``video-r1`` file (one JSON document) is read and checked here, the others line by line as
    the iterator is consumed.

    Raises:
        DatasetFileError: a ``video-r1`` file that is not a JSON list.
        OSError: ``path`` cannot be read.
    """
    if fmt == "video-r1":
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise DatasetFileError(f"{path}: not JSON ({error})") from error
        if not isinstance(records, list):
            raise DatasetFileError(
                f"{path}: a Video-R1 file is a JSON list of records, got {type(records).__name__}"
            )
        return (
            (number, record if isinstance(record, dict) else RowError(number, "record is not a JSON object"))
            for number, record in enumerate(records, start=1)
        )
    return _file_records(path, fmt)


def _file_records(path: Path, fmt: str) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    if fmt == "nextqa" and path.suffix.lower() == ".csv":
        with path.open(encoding="utf-8", newline="") as handle:
            # The header is line 1; DictReader counts physical lines read so far.
            reader = csv.DictReader(handle)
            for record in reader:
                yield reader.line_num, record
    else:
        with path.open(encoding="utf-8") as handle:
            yield from _jsonl_records(handle)


def _jsonl_records(handle: TextIO) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    for number, line in enumerate(handle, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            yield number, RowError(number, f"invalid JSON: {error.msg} (column {error.colno})")
            continue
        yield number, record if isinstance(record, dict) else RowError(number, "not a JSON object")


# --- convert -----------------------------------------------------------------------------------------


def convert_records(
    records: Iterator[tuple[int, dict[str, Any] | RowError]],
    fmt: str,
    *,
    media_root: Path,
    video_template: str = "{video}.mp4",
    progress: bool = True,
) -> tuple[list[dict[str, Any]], list[RowError]]:
    """Gym rows for the good records and a :class:`RowError` for each bad one, in input order."""
    converters: dict[
        str, Callable[[dict[str, Any]], tuple[str, str, dict[str, str] | None, str, str | None]]
    ] = {
        "video-r1": _from_video_r1,
        "nextqa": lambda record: _from_nextqa(record, video_template),
        "generic": _from_generic,
    }
    if fmt not in converters:
        raise ValueError(f"unknown format {fmt!r}; supported formats are {', '.join(FORMATS)}")
    rows: list[dict[str, Any]] = []
    errors: list[RowError] = []
    for line, record in tqdm(
        records, desc=f"convert {fmt}", unit="row", disable=not progress, file=sys.stderr
    ):
        if isinstance(record, RowError):
            errors.append(record)
            continue
        try:
            video, question, options, answer, record_id = converters[fmt](record)
            reference = _media_reference(video, media_root)
            rows.append(_row(reference, question, options, answer, record_id or f"{fmt}-{line}"))
        except (KeyError, ValueError, TypeError, MediaError) as error:
            reason = f"missing field {error.args[0]!r}" if isinstance(error, KeyError) else str(error)
            errors.append(RowError(line, reason))
    return rows, errors


def _from_video_r1(record: dict[str, Any]) -> tuple[str, str, dict[str, str] | None, str, str | None]:
    if record.get("data_type", "video") != "video":
        raise ValueError(f"data_type is {record['data_type']!r}; only video records convert")
    options = None
    if record.get("options"):
        options = {}
        for text in record["options"]:
            match = _VIDEO_R1_OPTION.match(str(text))
            if not match:
                raise ValueError(f"option {text!r} does not start with a letter label such as 'A.'")
            options[match.group(1)] = match.group(2).strip()
    solution = str(record["solution"])
    match = _VIDEO_R1_ANSWER.search(solution)
    answer = (match.group(1) if match else solution).strip()
    record_id = record.get("problem_id")
    return (
        str(record["path"]),
        str(record["problem"]),
        options,
        answer,
        None if record_id is None else str(record_id),
    )


def _from_nextqa(
    record: dict[str, Any], video_template: str
) -> tuple[str, str, dict[str, str] | None, str, str | None]:
    texts = [record[f"a{index}"] for index in range(5) if record.get(f"a{index}") not in (None, "")]
    if len(texts) < 2:
        raise ValueError("needs at least two options a0, a1, ...")
    answer_index = int(record["answer"])
    if not 0 <= answer_index < len(texts):
        raise ValueError(f"answer index {answer_index} is not one of the {len(texts)} options")
    options = {_LETTERS[index]: str(text) for index, text in enumerate(texts)}
    qid = record.get("qid")
    record_id = f"{record['video']}-{qid}" if qid not in (None, "") else None
    return (
        video_template.format(**record),
        str(record["question"]),
        options,
        _LETTERS[answer_index],
        record_id,
    )


def _from_generic(record: dict[str, Any]) -> tuple[str, str, dict[str, str] | None, str, str | None]:
    options = record.get("options")
    if isinstance(options, list):
        options = {_LETTERS[index]: str(text) for index, text in enumerate(options)}
    elif options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be an object or a list, got {type(options).__name__}")
    record_id = record.get("id")
    if "prompt" in record:
        prompt = record["prompt"]
    elif "question" in record:
        prompt = record["question"]
    else:
        raise ValueError("missing field 'prompt' (or 'question')")
    return (
        str(record["video"]),
        str(prompt),
        options,
        str(record["answer"]),
        (None if record_id is None else str(record_id)),
    )


def _media_reference(video: str, media_root: Path) -> str:
    """``video`` as a reference relative to the media root (URLs other than ``file://`` unchanged)."""
    scheme = urllib.parse.urlsplit(video).scheme.lower()
    if scheme in ("data", "http", "https"):
        return video
    path = resolve_local_media(
        media_ref({"type": VIDEO_PART_TYPE, "video_url": video}).value, _settings(media_root)
    )
    return path.relative_to(media_root.resolve()).as_posix()


def _row(
    video: str, question: str, options: dict[str, str] | None, answer: str, record_id: str
) -> dict[str, Any]:
    lines = [question.strip()]
    if options is not None:
        if answer not in options:
            raise ValueError(f"answer {answer!r} is not one of the option letters {sorted(options)}")
        lines += [f"{letter}. {text}" for letter, text in options.items()]
        lines.append(BOXED_INSTRUCTION)
    content = [{"type": "input_video", "video_url": video}, {"type": "input_text", "text": "\n".join(lines)}]
    row: dict[str, Any] = {
        "responses_create_params": {"input": [{"role": "user", "content": content}]},
        "task_id": record_id,
        "answer": answer,
    }
    if options is not None:
        row["options"] = options
    return row


# --- validate ---------------------------------------------------------------------------------------


def validate_row(
    row: Any, settings: MediaSettings, *, decode: bool = True, limits: DecodeLimits = DEFAULT_LIMITS
) -> list[str]:
    """Every problem of one Gym row (empty when it is valid), each naming its place and reason.

    Args:
        row: one Gym row (``responses_create_params`` plus task fields).
        settings: media root and byte limits (see :class:`~gym_video_env.hookspecs.MediaSettings`).
        decode: also decode each media part (see the module docstring).
        limits: resource bounds for decoding; ``settings.max_video_bytes``, when smaller, bounds
            the bytes too.
    """
    if settings.max_video_bytes is not None and settings.max_video_bytes < limits.max_input_bytes:
        limits = dataclasses.replace(limits, max_input_bytes=settings.max_video_bytes)
    if not isinstance(row, dict):
        return [f"a row is a JSON object, got {type(row).__name__}"]
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        return ["missing responses_create_params (an object)"]
    items = params.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        return ["responses_create_params.input must be a string or a non-empty list of items"]
    problems: list[str] = []
    pm = get_plugin_manager()
    for index, item in enumerate(items):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "function_call":
            continue
        if kind == "function_call_output":
            content, key = item.get("output"), "output"
        elif isinstance(item, dict) and "role" in item:
            content, key = item.get("content"), "content"
        else:
            problems.append(
                f"input[{index}]: not a message (an object with a role), a function_call or a "
                "function_call_output"
            )
            continue
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            problems.append(f"input[{index}].{key}: must be a string or a list of parts")
            continue
        for part_index, part in enumerate(content):
            where = f"input[{index}].{key}[{part_index}]"
            if not isinstance(part, dict) or "type" not in part:
                problems.append(f"{where}: not a content part (an object with a type)")
            elif part["type"] in MEDIA_PART_TYPES:
                try:
                    pm.hook.validate_media(part=part, settings=settings)
                    if decode:
                        _check_decodes(part, settings, limits)
                except MediaError as error:
                    problems.append(f"{where}: {error}")
            elif part["type"] not in KNOWN_PART_TYPES:
                problems.append(
                    f"{where}: unknown content part type {part['type']!r}; known types are "
                    f"{', '.join(sorted(KNOWN_PART_TYPES))}"
                )
    options, answer = row.get("options"), row.get("answer")
    if options is not None:
        if not isinstance(options, dict) or not options:
            problems.append("options must be a non-empty object (letter -> text)")
        elif answer not in options:
            problems.append(f"answer {answer!r} is not one of the option letters {sorted(options)}")
    return problems


def validate_rows(
    path: Path,
    settings: MediaSettings,
    *,
    decode: bool = True,
    limits: DecodeLimits = DEFAULT_LIMITS,
    progress: bool = True,
) -> tuple[int, list[RowError]]:
    """The number of rows of the JSONL file ``path`` and an error per problem, with line numbers
    (arguments as for :func:`validate_row`)."""
    count = 0
    errors: list[RowError] = []
    with path.open(encoding="utf-8") as handle:
        for line, record in tqdm(
            _jsonl_records(handle), desc="validate", unit="row", disable=not progress, file=sys.stderr
        ):
            count += 1
            if isinstance(record, RowError):
                errors.append(record)
                continue
            problems = validate_row(record, settings, decode=decode, limits=limits)
            errors += [RowError(line, problem) for problem in problems]
    return count, errors


def _check_decodes(part: dict[str, Any], settings: MediaSettings, limits: DecodeLimits) -> None:
    """Decode a part's media: a video at :data:`VALIDATE_FRAMES` points, every frame of a
    cached-frame manifest, an image. Remote media are skipped (the validator fetches nothing)."""
    ref = media_ref(part)
    if ref.kind == "remote":
        return
    if ref.kind == "file":
        path = resolve_local_media(ref.value, settings)
        label, data = ref.value, None
    else:
        header, _, payload = ref.value.partition(",")
        label = f"{ref.value[:40]}..."
        try:
            data = (
                base64.b64decode(payload, validate=True)
                if header.lower().endswith(";base64")
                else urllib.parse.unquote_to_bytes(payload)
            )
        except ValueError as error:
            raise MediaError(label, f"invalid base64 payload ({error})") from error
    try:
        if part["type"] != VIDEO_PART_TYPE:
            with Image.open(io.BytesIO(data) if data is not None else path) as image:
                image.load()
            return
        source = data if data is not None else path.read_bytes()
        if sniff_media(source) == "video":
            decode_frames(source, _VALIDATE_CONTRACT, limits=limits)
        else:
            load_manifest_frames(source, _EVERY_FRAME, media_root=settings.media_root, limits=limits)
    except (VideoGRPOError, OSError) as error:
        reason = error.reason if isinstance(error, (VideoDecodeError, ManifestError)) else str(error)
        raise MediaError(label, f"does not decode: {reason}") from error


# --- command line ------------------------------------------------------------------------------------


def _settings(media_root: Path) -> MediaSettings:
    return MediaSettings(media_root=media_root)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Video-QA datasets as NeMo Gym rows.")
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser(
        "convert",
        help="convert a video-QA dataset to Gym rows (JSONL)",
        description="Convert a video-QA dataset to video_mcqa Gym rows (JSONL).",
        epilog=GENERIC_FORMAT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("--format", required=True, choices=FORMATS)
    convert.add_argument("input", type=Path)
    convert.add_argument("output", type=Path)
    convert.add_argument("--media-root", required=True, type=Path, help="directory the videos must be in")
    convert.add_argument(
        "--video-template", default="{video}.mp4", help="nextqa: video file from the record's fields"
    )
    validate = commands.add_parser("validate", help="check Gym rows (JSONL) and their media")
    validate.add_argument("rows", type=Path)
    validate.add_argument("--media-root", required=True, type=Path)
    validate.add_argument("--max-video-bytes", type=int, default=None, help="largest video, in bytes")
    validate.add_argument("--no-decode", action="store_true", help="skip decoding each video and image")
    validate.add_argument(
        "--max-frame-pixels",
        type=int,
        default=DEFAULT_LIMITS.max_frame_pixels,
        help="largest frame area, width x height in pixels",
    )
    validate.add_argument(
        "--max-frames", type=int, default=DEFAULT_LIMITS.max_frames, help="most frames a video may have"
    )
    validate.add_argument(
        "--decode-timeout-s",
        type=float,
        default=DEFAULT_LIMITS.timeout_s,
        help="longest decode of one video, in seconds",
    )
    generate = commands.add_parser("generate", help="write synthetic clips and their rows")
    generate.add_argument("environment", choices=_row_generator_names(), help="an installed row generator")
    generate.add_argument("output", type=Path)
    generate.add_argument("--media-root", required=True, type=Path)
    generate.add_argument("-n", type=int, default=16, help="number of rows")
    generate.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m gym_video_env.datasets") -> int:
    """Run the command line; returns the exit status: 1 when any record was bad, 2 (and one line on
    stderr) when an input file or directory is missing or unreadable."""
    args = _parser(prog).parse_args(argv)
    try:
        return _run(args, prog)
    except (DatasetFileError, UnicodeDecodeError, OSError) as error:
        if isinstance(error, OSError) and error.filename is None:
            raise  # not a file of the command line's
        source = args.input if args.command == "convert" else getattr(args, "rows", args.output)
        print(f"{prog} {args.command}: {_file_error(error, source)}", file=sys.stderr)
        return 2


def _row_generator_names() -> list[str]:
    """The names of the installed row generators
    (:data:`~gym_video_env.environments.ROW_GENERATORS_GROUP`)."""
    return sorted(ep.name for ep in metadata.entry_points(group=ROW_GENERATORS_GROUP))


def _file_error(error: BaseException, source: Path) -> str:
    if isinstance(error, IsADirectoryError):
        return f"{error.filename}: is a directory, not a file"
    if isinstance(error, OSError):
        return f"{error.filename}: {(error.strerror or str(error)).lower()}"
    if isinstance(error, UnicodeDecodeError):
        return f"{source}: not a UTF-8 text file ({error.reason} at byte {error.start})"
    return " ".join(str(error).split())


def _run(args: argparse.Namespace, prog: str) -> int:
    media_root = args.media_root.resolve()
    if args.command == "generate":
        make = row_generator(args.environment)
        out = write_rows_jsonl(make(media_root, args.n, seed=args.seed), args.output)
        print(f"wrote {args.n} rows to {out}, clips under {media_root}")
        return 0
    if not media_root.is_dir():
        print(f"{prog} {args.command}: --media-root {args.media_root} is not a directory", file=sys.stderr)
        return 2
    source = args.input if args.command == "convert" else args.rows
    if not source.is_file():  # before a progress bar starts
        what = "is a directory, not a file" if source.is_dir() else "no such file"
        print(f"{prog} {args.command}: {source}: {what}", file=sys.stderr)
        return 2
    if args.command == "convert":
        rows, errors = convert_records(
            read_records(args.input, args.format),
            args.format,
            media_root=media_root,
            video_template=args.video_template,
        )
        write_rows_jsonl(rows, args.output)
        print(f"wrote {len(rows)} rows to {args.output}; {len(errors)} records could not be converted")
    else:
        settings = MediaSettings(media_root=media_root, max_video_bytes=args.max_video_bytes)
        limits = DecodeLimits(
            max_frame_pixels=args.max_frame_pixels,
            max_frames=args.max_frames,
            timeout_s=args.decode_timeout_s,
        )
        count, errors = validate_rows(args.rows, settings, decode=not args.no_decode, limits=limits)
        bad_lines = len({error.line for error in errors})
        print(f"{count} rows, {count - bad_lines} valid, {bad_lines} invalid")
    source = args.input if args.command == "convert" else args.rows
    for error in errors:
        print(f"{source}:{error.line}: {error.reason}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
