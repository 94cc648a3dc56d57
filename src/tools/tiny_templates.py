"""Chat templates of the tiny test models, shaped like their chat family's real template (each tiny model of
:mod:`tools.tiny_model` names its own), and a plain template of turn markers for a family without one.

Written for Trident, not copied: each reproduces the token layout its family's instruct models use (special tokens,
system block, tool declarations, tool-call syntax, tool results), so that a renderer or tool parser built for the
real family works on the tiny model, and a mismatch shows up in tests as it would with the real one.
"""

import json

# The tool declarations of a ChatML system turn (Qwen3 and Qwen2.5 write the same text): the JSON of each tool in
# <tools>, then how to call one.
HERMES_TOOLS = """\
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    + '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    + '\\n</tool_call>' }}
"""

# The rest of a ChatML assistant turn after its text (Qwen3, Qwen3-VL): each tool call as JSON in <tool_call>, then
# <|im_end|>; tool results as <tool_response> blocks in one user turn; the end of the loop over messages.
HERMES_CALLS_AND_RESULTS = """\
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{%- if loop.first and content %}
{{- '\\n' }}
{%- elif not loop.first %}
{{- '\\n' }}
{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}
{{- call.arguments }}
{%- else %}
{{- call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
"""

# Qwen3: ChatML turns, tools declared in the system turn as JSON lines in <tools>, calls as JSON in <tool_call>,
# results as <tool_response> in a user turn; earlier turns' <think> blocks are dropped once a user speaks again.
QWEN3 = (
    """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
"""
    + HERMES_TOOLS
    + """\
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages | length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages | length - 1) - loop.index0 %}
{%- if message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>')) %}
{%- set ns.last_query_index = index %}
{%- break %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and reasoning %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\\n' + content }}
{%- endif %}
"""
    + HERMES_CALLS_AND_RESULTS
    + """\
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
)

# Qwen2.5: ChatML like Qwen3, with a default system prompt when none is given, the same tool syntax, and no thinking.
QWEN2_5 = (
    """\
{%- set default_system = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' %}
{%- set system = messages[0].content if messages[0].role == 'system' else default_system %}
{{- '<|im_start|>system\\n' + system }}
{%- if tools %}
{{- '\\n\\n' }}
"""
    + HERMES_TOOLS
    + """\
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first)
      or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\\n' + message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

# Qwen3-VL Instruct: ChatML like Qwen3 without thinking; a message's content may be a list of parts, each image part
# written <|vision_start|><|image_pad|><|vision_end|> (the server expands the one <|image_pad|> to the image's tokens),
# in tool results too; assistant history is kept as written.
QWEN3_VL = (
    """\
{%- macro render_content(content) %}
{%- if content is string %}
{{- content }}
{%- else %}
{%- for part in content %}
{%- if part.type in ('image', 'image_url') or part.image or part.image_url %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part.text is defined %}
{{- part.text }}
{%- endif %}
{%- endfor %}
{%- endif %}
{%- endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- render_content(messages[0].content) + '\\n\\n' }}
{%- endif %}
"""
    + HERMES_TOOLS
    + """\
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = render_content(message.content) if message.content else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' + content }}
"""
    + HERMES_CALLS_AND_RESULTS
    + """\
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

# Llama 3.1 / 3.2 Instruct: header-delimited turns closed by <|eot_id|>, a system block that always carries the
# knowledge-cutoff and date lines, tools declared (indented JSON) in the first user turn by default, a call as the
# whole assistant turn {"name": ..., "parameters": ...} (one per turn), results in an `ipython` turn as JSON.
LLAMA3 = """\
{{- bos_token }}
{%- if date_string is not defined %}
{%- set date_string = '26 Jul 2024' %}
{%- endif %}
{%- if tools_in_user_message is not defined %}
{%- set tools_in_user_message = true %}
{%- endif %}
{%- set tool_intro = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    + 'value}.Do not use variables.\\n\\n' %}
{%- if messages[0].role == 'system' %}
{%- set system_message = messages[0].content | trim %}
{%- set messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
{{- 'Environment: ipython\\n' }}
{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}
{%- if tools and not tools_in_user_message %}
{{- 'You have access to the following functions. To call a function, please respond with JSON for a function call.'
    + tool_intro }}
{%- for tool in tools %}
{{- (tool | tojson(indent=4)) + '\\n\\n' }}
{%- endfor %}
{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools and tools_in_user_message %}
{%- if not messages %}
{{- raise_exception('tools go into the first user message, and there is none') }}
{%- endif %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '
    + 'that best answers the given prompt.\\n\\n' + tool_intro }}
{%- for tool in tools %}
{{- (tool | tojson(indent=4)) + '\\n\\n' }}
{%- endfor %}
{{- (messages[0].content | trim) + '<|eot_id|>' }}
{%- set messages = messages[1:] %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or message.content is iterable %}
{{- message.content | tojson }}
{%- else %}
{{- message.content }}
{%- endif %}
{{- '<|eot_id|>' }}
{%- elif message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set call = message.tool_calls[0].function if message.tool_calls[0].function else message.tool_calls[0] %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": '
    + (call.arguments | tojson) + '}<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


# Plain turns: the tools as JSON lines in a system turn, a tool call as JSON after the reply's text, tool results in a
# turn of role "tool", a newline after each turn's end.
PLAIN = """\
{%- if bos_token %}
{{- bos_token }}
{%- endif %}
{%- if tools %}
{{- turn_start + 'system' + role_end + '# Tools' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- turn_end + '\\n' }}
{%- endif %}
{%- for message in messages %}
{{- turn_start + message.role + role_end }}
{%- if message.content is string %}
{{- message.content }}
{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
{{- '{"name": "' + call.name + '", "arguments": ' }}
{%- if call.arguments is string %}
{{- call.arguments }}
{%- else %}
{{- call.arguments | tojson }}
{%- endif %}
{{- '}' }}
{%- endfor %}
{{- turn_end + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- turn_start + 'assistant' + role_end }}
{%- endif %}
"""


def plain(turn_start: str, role_end: str, turn_end: str) -> str:
    """:data:`PLAIN` for a family's turn markers (``turn_start`` role ``role_end`` content ``turn_end``)."""
    markers = {"turn_start": turn_start, "role_end": role_end, "turn_end": turn_end}
    return "".join(f"{{%- set {name} = {json.dumps(text)} %}}\n" for name, text in markers.items()) + PLAIN
