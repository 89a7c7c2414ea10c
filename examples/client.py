"""Talk to an LLMDeployment with the official OpenAI client.

From outside the cluster, forward the Service first:

    kubectl port-forward svc/smollm2 8000:8000
    python examples/client.py --base-url http://127.0.0.1:8000/v1

Inside the cluster the base URL is ``status.endpoint``:
``http://<name>.<namespace>.svc.cluster.local:8000/v1``.
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--prompt", default="What is a GPU?")
    args = parser.parse_args()

    # kvpilot needs no API key; the client insists on one.
    client = OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": args.prompt}],
        max_tokens=128,
        stream=True,  # sampling: the model's recommended settings (its generation config)
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
