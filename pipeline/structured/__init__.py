"""Structured output: constraining decoding to a JSON schema, a regex, a choice or a grammar.

`spec.StructuredOutputs` is what a request asks for (on SamplingParams); `compiler` compiles it
off the step loop into an xgrammar grammar, cached by the spec's hash; `gate` holds a request
until its grammar is ready; `matchers` (owned by the scheduler) keeps each sequence's matcher
state, rebuilt from the sequence's tokens, and packs the step's token masks into the plan.
"""
