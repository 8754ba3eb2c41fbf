"""Prompt dataset and multimodal flags."""

from relax.config.types import json_object


# The multimodal processor settings configure the HF processor of multimodal training inputs; Relax's trainer builds
# text-only models, so they are refused (multimodal_keys' inputs reach SGLang engines as they are).
_MM = (" The trainer builds text-only models, so the multimodal processor this configures is not built yet "
       "(inputs named by --multimodal-keys reach SGLang engines as they are).")


def add_flags(parser):
    g = parser.add_argument_group("Dataset")
    g.add_argument("--prompt-data", type=str, default=None, help="Training prompts: a JSONL or Parquet file.")
    g.add_argument("--input-key", type=str, default="input", help="Field holding the prompt (text or chat messages).")
    g.add_argument("--label-key", type=str, default=None, help="Field holding the reference answer.")
    g.add_argument("--metadata-key", type=str, default="metadata", help="Field holding per-sample metadata (a dict).")
    g.add_argument("--tool-key", type=str, default="tools", help="Field holding tool definitions for the chat template.")
    g.add_argument("--apply-chat-template", action="store_true", default=False,
                   help="Treat the prompt as OpenAI-style messages and render it with the tokenizer's chat template.")
    g.add_argument("--apply-chat-template-kwargs", type=json_object, default={},
                   help="Extra keyword arguments (JSON object) for apply_chat_template.")
    g.add_argument("--system-prompt", type=str, default=None, help="Text placed before every prompt as a system turn.")
    g.add_argument("--rollout-shuffle", action="store_true", default=False, help="Shuffle prompts each epoch.")
    g.add_argument("--rollout-seed", type=int, default=42, help="Seed for prompt shuffling and rollout randomness.")
    g.add_argument("--use-streaming-dataset", action="store_true", default=False,
                   help="Read the prompt file lazily with bounded memory.")
    g.add_argument("--streaming-buffer-size", type=int, default=10000,
                   help="Prompts held in memory by the streaming reader (also its shuffle window).")
    g.add_argument("--skip-bad-lines", action="store_true", default=False,
                   help="Skip malformed prompt lines (counted as rollout/bad_lines) instead of stopping with an "
                        "error that names the file and line.")
    g.add_argument("--data-source-path", type=str,
                   default="relax.engine.rollout.data_source.RolloutDataSourceWithBuffer",
                   help="Dotted path of the prompt data source class.")
    g.add_argument("--start-rollout-id", type=int, default=None,
                   help="First rollout step; when unset it comes from the checkpoint in --load (else 0).")

    g = parser.add_argument_group("Multimodal data")
    g.add_argument("--multimodal-keys", type=json_object, default=None,
                   help='Map of modality to dataset field as JSON, e.g. \'{"image": "images"}\'; sent to SGLang as image_data/video_data/audio_data (not the embedded engine).')
    g.add_argument("--use-audio-in-video", action="store_true", default=False, help="Also use the audio track of videos." + _MM)
    g.add_argument("--image-max-token-num", type=int, default=None, help="Upper bound of tokens per image (unset: the processor's own, 16384)." + _MM)
    g.add_argument("--image-min-token-num", type=int, default=None, help="Lower bound of tokens per image (unset: the processor's own, 4)." + _MM)
    g.add_argument("--video-min-token-num", type=int, default=None, help="Lower bound of tokens per video frame (unset: the processor's own, 128)." + _MM)
    g.add_argument("--video-max-token-num", type=int, default=None, help="Upper bound of tokens per video frame (unset: the processor's own, 768)." + _MM)
    g.add_argument("--video-fps", type=float, default=None, help="Frames per second sampled from videos (unset: the processor's own, 2.0)." + _MM)
    g.add_argument("--video-fps-min-frames", type=int, default=None, help="Fewest frames taken from a video (unset: the processor's own, 4)." + _MM)
    g.add_argument("--video-fps-max-frames", type=int, default=None, help="Most frames taken from a video (unset: the processor's own, 768)." + _MM)
    g.add_argument("--audio-sample-rate", type=int, default=None, help="Audio resampling rate in Hz (unset: the processor's own, 16000)." + _MM)
    g.add_argument("--frame-factor", type=int, default=None, help="Frame count alignment (unset: the processor's own, 2)." + _MM)
    g.add_argument("--mm-processor-pool-size", type=int, default=0,
                   help="Worker processes for multimodal preprocessing; 0 uses a thread pool." + _MM)
