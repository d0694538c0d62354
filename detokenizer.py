"""
detokenizer.py: the text of each sample as its tokens come, and the stop strings that end it,
as vLLM's detokenizer does them. The engine imports it only when it is given a tokenizer (any
object with decode(ids) -> str: a Hugging Face `tokenizers.Tokenizer`, or demo.Tokenizer's
bytes); it imports nothing of the project.

A token's text depends on the tokens before it: a byte-level BPE splits a multi-byte character
across tokens, a SentencePiece tokenizer drops the space at the start of what it decodes. So a
new token is decoded within a window of a few tokens before it, and what it adds is the window's
text past the text the window had without it; text that ends in U+FFFD, the character a decoder
puts for a character whose last bytes are still to come, waits for them (vLLM's incremental
detokenizer, text-generation-inference's decode_token).
"""

CONTEXT = 5  # prompt tokens a sample's first token is decoded after (vLLM's initial offset)


def check_stop_strings(text, num_new_chars, stop, include_in_output):
    """vLLM's rule, after num_new_chars characters were added to text: the first stop string, in
    the order given, found where it may end in the new characters. Returns (that string, the
    length to cut the text to: where it starts, or where it ends if include_in_output; -1 if that
    is the end anyway), or None."""
    if not num_new_chars:
        return None
    for s in stop:
        start = text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))
        if start == -1:
            continue
        end = start + len(s) if include_in_output else start
        return s, -1 if end >= len(text) else end
    return None


class Detokenizer:
    """Grows each sequence's seq.text by its newest token and ends it at a stop string. The
    state it keeps lives on the sequence (seq.text and seq.text_offsets), so forks copy it and a
    failed step's undo restores it with the rest of the sequence."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode

    def start(self, seq):
        """Offsets into seq.token_ids: the window begins a few prompt tokens back, and the text
        read so far ends at the prompt's end."""
        seq.text, seq.text_offsets = "", (max(seq.num_prompt_tokens - CONTEXT, 0),
                                          seq.num_prompt_tokens)

    def update(self, seq, params):
        """Add the newest token's text; if it completes a stop string (counted only after
        min_tokens tokens, as in vLLM), cut the text there and return the string."""
        ids, (prefix, read) = seq.token_ids, seq.text_offsets
        before = self.decode(ids[prefix:read])
        after = self.decode(ids[prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return None  # no new text yet, or a character still to complete
        new = after[len(before):]
        seq.text += new
        seq.text_offsets = (read, len(ids))
        if not params.stop or seq.num_output_tokens <= params.min_tokens:
            return None
        found = check_stop_strings(seq.text, len(new), params.stop,
                                   params.include_stop_str_in_output)
        if found is None:
            return None
        stop, cut = found
        if cut != -1:
            seq.text = seq.text[:cut]
        return stop

    @staticmethod
    def visible(seq, params, finished):
        """The text a streamed output shows: while the sequence runs, all but the last
        len(longest stop string) - 1 characters, which may yet begin a stop string to cut."""
        hold = 0 if finished or params.include_stop_str_in_output or not params.stop else \
            max(map(len, params.stop)) - 1
        return seq.text[:max(0, len(seq.text) - hold)]
