#!/usr/bin/env bash
# Convert a Video-R1-style dataset into NeMo Gym rows and validate them.
#
#   examples/convert_video_r1.sh [WORK_DIR]
#
# Writes a small Video-R1 file (two good records and one whose option has no letter label) next
# to two synthetic clips, converts it with `video-grpo gym-dataset convert --format video-r1`
# (the bad record is reported as FILE:LINE: reason and left out; the good ones are written), then
# checks the rows with `gym-dataset validate` (shape, media inside the media root, decoding).
# With your own data: keep the two commands, point them at your file and your video directory.
set -euo pipefail

# The installed `video-grpo` (either environment has these commands), or $VIDEO_GRPO.
video_grpo="${VIDEO_GRPO:-video-grpo}"
command -v "$video_grpo" > /dev/null || {
  echo "convert_video_r1.sh: $video_grpo is not on PATH: install video-grpo, or put its environment's" \
    "bin directory on PATH (a checkout's envs/main/.venv/bin), or set VIDEO_GRPO" >&2
  exit 2
}
work="${1:-$(mktemp -d -t convert_video_r1.XXXXXX)}"
media="$work/videos"
mkdir -p "$media"

# Two clips to ask about (any videos under the media root work the same).
"$video_grpo" make-clips "$media/clips" --task colour -n 2 --media-root "$media" > /dev/null

# A Video-R1 file: a JSON list; options "A. text", solution "<answer>X</answer>", path relative
# to the media root (or absolute inside it).
cat > "$work/video_r1.json" <<'JSON'
[
  {"problem_id": 1, "data_type": "video", "problem": "Apart from black, which colour appears in this video?",
   "options": ["A. green", "B. cyan", "C. magenta", "D. red"], "solution": "<answer>C</answer>",
   "path": "clips/colour-s0-00000.mp4"},
  {"problem_id": 2, "data_type": "video", "problem": "Apart from black, which colour appears in this video?",
   "options": ["A. red", "B. blue"], "solution": "<answer>A</answer>", "path": "clips/colour-s0-00001.mp4"},
  {"problem_id": 3, "data_type": "video", "problem": "Which shape is shown?",
   "options": ["circle", "square"], "solution": "<answer>A</answer>", "path": "clips/colour-s0-00001.mp4"}
]
JSON

# Convert: exit status 1 because record 3 is bad; the two good rows are written all the same.
status=0
"$video_grpo" gym-dataset convert --format video-r1 "$work/video_r1.json" "$work/rows.jsonl" \
  --media-root "$media" || status=$?
echo "convert exit status: $status (1: some records were bad, reported above)"

# Validate what was written: every row's shape, media confinement and decoding.
"$video_grpo" gym-dataset validate "$work/rows.jsonl" --media-root "$media"
echo "rows: $work/rows.jsonl"
