"""Text to tokens and back: tokenizers, chat templates, preprocessing, detokenization, stop strings, output parsers."""
