"""Chat templates and assistant-only loss masks.

The loss covers assistant tokens only: each assistant turn's content and its end-of-turn token,
never role headers or system/user turns. For a Hugging Face template we do not parse the template;
we render growing prefixes of the conversation and diff token counts:

    head_i = tokens(render(messages[:i], add_generation_prompt=True))   # ... "<|im_start|>assistant\n"
    turn_i = tokens(render(messages[:i + 1]))                           # ... content "<|im_end|>\n"
    mask[len(head_i):len(turn_i)] = 1, trimmed after the last end-of-turn token in that span

This holds only if every prefix tokenises to a prefix of the full conversation ("prefix-stable");
we verify that and raise ChatTemplateError otherwise, rather than train on a wrong mask.

Tool turns are inline in the assistant's text, in the protocol of megarl/rollout/tools.py, as in
nanochat: the model writes the call, the rollout injects the tool's output (an observation) and
the model goes on, all in one assistant turn. In a demonstration, an observation is recognised
by its markers: GSM8K's calculator annotation `<<48/2=24>>` is the call `<<48/2=` (trained) and
the observation `24>>` (masked out: the model never writes it, so it is not learned); a python
or user tool's `<output>...</output>` after its call is an observation too. Text is tokenised
piece by piece at those boundaries, exactly as the rollout tokenises it (the sampled call, then
`encode(observation)`), so SFT and RL see the same tokens.
"""
import json
import re
from datetime import datetime

from megarl.data.errors import DataError


class ChatTemplateError(DataError):
    """The chat template cannot render this conversation, or not in a prefix-stable way."""


# The built-in template for tokenizers without one: ChatML as plain text. Tokenizers that define
# <|im_start|>/<|im_end|> as added tokens encode the markers as single tokens.
CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"


def render_chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    text = "".join(f"{CHATML_START}{m['role']}\n{m['content']}{CHATML_END}\n" for m in messages)
    return text + (f"{CHATML_START}assistant\n" if add_generation_prompt else "")


# Observations inside assistant text (megarl/rollout/tools.py's protocol): the calculator's result
# after `<<expression=` up to `>>`, and any `<output>...</output>`.
_OBSERVATION = re.compile(r"<<[0-9+\-*/%().,\s]{1,200}=([^<>\n]{0,200}>>)|(<output>.*?</output>)", re.DOTALL)


def tool_segments(text: str) -> list[tuple[str, bool]]:
    """text -> [(piece, is_observation)], in order, joining back to text (no empty pieces)."""
    out, pos = [], 0
    for m in _OBSERVATION.finditer(text):
        group = 1 if m.group(1) is not None else 2
        start = m.start(group)
        if start > pos:
            out.append((text[pos: start], False))
        out.append((m.group(group), True))
        pos = m.end(group)
    if pos < len(text):
        out.append((text[pos:], False))
    return out


def encode_with_observations(encode, text: str) -> tuple[list[int], list[int]]:
    """Token ids of text, encoded piece by piece at observation boundaries, and a 0/1 flag per
    token (1 = observation). Text without observations is encode(text) itself."""
    ids, observed = [], []
    for piece, is_obs in tool_segments(text):
        piece_ids = encode(piece)
        ids += piece_ids
        observed += [int(is_obs)] * len(piece_ids)
    return ids, observed


def compile_jinja_template(source: str):
    """Compile a Hugging Face chat template the way transformers does (sandboxed jinja2)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise DataError("this tokenizer has a chat template, which needs jinja2: pip install jinja2") from None

    class GenerationTag(jinja2.ext.Extension):
        """Accept transformers' {% generation %}...{% endgeneration %} markers; render the body as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers overrides jinja's tojson, which would HTML-escape
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"chat template does not compile: {e.message} (template line {e.lineno})") from None


def render_jinja(template, messages: list[dict], add_generation_prompt: bool, special_tokens: dict) -> str:
    import jinja2

    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=None, documents=None, **special_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template refused the conversation: {e}") from None


def assistant_mask_by_prefixes(render, encode, messages: list[dict], end_ids) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and a 0/1 mask of assistant tokens (see module doc).

    render(messages, add_generation_prompt) -> str; encode(str) -> list[int];
    end_ids: end-of-turn token ids; anything the template prints after the last one in an
    assistant span (e.g. ChatML's newline) is left out of the mask.
    """
    ids = encode(render(messages, False))
    mask = [0] * len(ids)
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        head = encode(render(messages[:i], True))
        turn = encode(render(messages[: i + 1], False))
        for what, part in ((f"messages[:{i}] with the generation prompt", head), (f"messages[:{i + 1}]", turn)):
            if ids[: len(part)] != part:
                raise ChatTemplateError(
                    f"chat template is not prefix-stable: {what} does not tokenise to a prefix of the whole "
                    f"conversation, so the loss mask of assistant message {i} cannot be located")
        start, end = len(head), len(turn)
        if end <= start:
            raise ChatTemplateError(f"chat template renders assistant message {i} as no tokens")
        for j in range(end - 1, start - 1, -1):
            if ids[j] in end_ids:
                end = j + 1
                break
        mask[start:end] = [1] * (end - start)
    return ids, mask
