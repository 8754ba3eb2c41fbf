"""Logging, metrics and notification flags."""


def add_flags(parser):
    g = parser.add_argument_group("TensorBoard")
    g.add_argument("--use-tensorboard", action="store_true", default=False, help="Write metrics to TensorBoard.")
    g.add_argument("--tb-project-name", type=str, default=None,
                   help="TensorBoard log directory (default $TENSORBOARD_DIR, else <output-dir>/tensorboard).")
    g.add_argument("--tb-experiment-name", type=str, default=None, help="Run name inside the TensorBoard directory.")

    g = parser.add_argument_group("ClearML")
    g.add_argument("--use-clearml", action="store_true", default=False, help="Report metrics to ClearML.")

    g = parser.add_argument_group("Metrics service")
    g.add_argument("--use-metrics-service", action="store_true", default=False,
                   help="Collect metrics from all roles in one service actor.")
    g.add_argument("--timeline-dump-dir", type=str, default=None, help="Write a Chrome-trace timeline of the roles here.")

    g = parser.add_argument_group("Logging options")
    g.add_argument("--log-passrate", action="store_true", default=False, help="Log pass@k over each prompt's samples.")
    g.add_argument("--log-multi-turn", action="store_true", default=False, help="Log multi-turn statistics (turns, tool calls, model vs environment tokens) as multi_turn/* metrics.")
    g.add_argument("--log-correct-samples", action="store_true", default=False, help="Log correct samples (reward > 0): rollout/correct_* metrics and a few per step in OUTPUT_DIR/correct_samples/step_N.jsonl.")
    g.add_argument("--log-reward-category", type=str, default=None, help="Key of the dict-valued reward that holds a category: count, fraction and mean reward per category as reward_category/<cat>/*.")

    g = parser.add_argument_group("Notifications")
    g.add_argument("--notify-urls", type=str, default=None, help="Comma-separated Apprise URLs notified on finish or failure.")
