from inference.routes import token_id_logprobs


def test_token_id_logprobs_adds_token_field_everywhere():
    data = {
        "choices": [
            {
                "logprobs": {
                    "content": [
                        {"token_id": 7, "logprob": -0.5, "top_logprobs": [{"token_id": 7, "logprob": -0.5}]},
                        {"token_id": 9, "logprob": -1.5, "top_logprobs": []},
                    ]
                }
            },
            {"logprobs": None},
        ]
    }
    out = token_id_logprobs(data)
    content = out["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["token_id:7", "token_id:9"]
    assert content[0]["top_logprobs"][0]["token"] == "token_id:7"
    assert content[0]["logprob"] == -0.5
