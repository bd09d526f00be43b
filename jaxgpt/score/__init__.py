"""What a model says of given text: log-likelihoods of continuations (likelihood), multiple-choice
items (choices), and records' prompts answered and scored (completions)."""
