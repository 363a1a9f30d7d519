"""kvpool.llm: the offline API, ``LLM(model).generate(prompts, params)`` with no manager or
worker process (``offline.py``). ``from kvpool import LLM, SamplingParams`` imports it lazily.

It builds the worker's engine over an in-process block manager and reads text through the front
door's tokenizers, detokenizer and stop-string cut, so offline output matches served output.
"""
