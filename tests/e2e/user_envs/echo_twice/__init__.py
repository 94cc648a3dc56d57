"""echo-twice: a taskset that brings its own harness. The harness runs the chat in-process (allowed by
`Harness.launch`'s contract: every model call goes through the endpoint it is given) and always asks twice."""

import verifiers.v1 as vf
from openai import AsyncOpenAI


class EchoConfig(vf.TasksetConfig):
    num_examples: int = 4


class EchoTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def replied_twice(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages) == 2)


class EchoTaskset(vf.Taskset[EchoTask, EchoConfig]):
    def load(self):
        for i in range(self.config.num_examples):
            yield EchoTask(vf.TaskData(id=f"echo-{i}", prompt=f"Repeat after me: {i} apples."), self.config.task)


class EchoHarnessConfig(vf.HarnessConfig):
    follow_up: str = "Once more, please."


class EchoHarness(vf.Harness[EchoHarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        client = AsyncOpenAI(base_url=endpoint, api_key=secret)
        messages = [{"role": "user", "content": data.prompt}]
        for _ in range(2):
            response = await client.chat.completions.create(model=ctx.model, messages=messages)
            messages += [{"role": "assistant", "content": response.choices[0].message.content or ""},
                         {"role": "user", "content": self.config.follow_up}]  # fmt: skip
        await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["EchoHarness", "EchoTaskset"]
