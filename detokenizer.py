"""
detokenizer.py: the text of each sample as its tokens come, and the stop strings that end it,
as vLLM's detokenizer does them. The engine uses it when it is given a tokenizer (any
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
    """The text of each sequence as its tokens come, and the stop strings that end it. The state
    it reads lives on the sequence (seq.text and seq.text_offsets), and texts() only computes:
    a step's run decodes, its commit keeps what the run decoded (nanopaged.py, section 10)."""

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode

    def start(self, seq):
        """Offsets into seq.token_ids: the window begins a few prompt tokens back, and the text
        read so far ends at the prompt's end."""
        seq.text, seq.text_offsets = "", (max(seq.num_prompt_tokens - CONTEXT, 0),
                                          seq.num_prompt_tokens)

    def texts(self, seq, tokens):
        """seq's text after each of tokens in turn, as (text, text_offsets, the characters that
        token added), without changing seq. Each token is decoded within its window; a token
        adds nothing while the character it begins is incomplete."""
        text, (prefix, read) = seq.text, seq.text_offsets
        base = prefix  # ids[i] is token base + i of the sequence with tokens appended
        ids, states = seq.token_ids[base:], []
        for token in tokens:
            ids.append(token)
            before = self.decode(ids[prefix - base:read - base])
            after = self.decode(ids[prefix - base:])
            new = ""
            if len(after) > len(before) and not after.endswith("\ufffd"):
                new = after[len(before):]
                text, prefix, read = text + new, read, base + len(ids)
            states.append((text, (prefix, read), new))
        return states

    @staticmethod
    def stop_string(text, new, params, num_output_tokens):
        """If the characters new, just added to text, complete one of params.stop (counted once
        the output is longer than min_tokens, as in vLLM): (that string, the text cut there)."""
        if not params.stop or num_output_tokens <= params.min_tokens:
            return None
        found = check_stop_strings(text, len(new), params.stop, params.include_stop_str_in_output)
        if found is None:
            return None
        stop, cut = found
        return stop, text if cut == -1 else text[:cut]

    @staticmethod
    def visible(seq, params, finished, start=0):
        """The text a streamed output shows, from character start on: while the sequence runs,
        all but the last len(longest stop string) - 1 characters, which may yet begin a stop
        string to cut (a stop string found later starts past them, so what was shown stays)."""
        hold = 0
        if not (finished or params.include_stop_str_in_output or not params.stop):
            hold = max(map(len, params.stop)) - 1
        return seq.text[start:max(0, len(seq.text) - hold)]
