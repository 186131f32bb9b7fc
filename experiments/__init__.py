"""What a researcher runs: configs, data pipelines, training, evaluation, reports."""
