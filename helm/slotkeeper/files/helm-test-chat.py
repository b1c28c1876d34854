# `helm test`: one chat round trip through the gateway's Service (standard library only).
import json
import os
import urllib.request

url = os.environ["SLOTKEEPER_TEST_URL"].rstrip("/")
key = os.environ.get("SLOTKEEPER_TEST_KEY", "")
headers = {"Content-Type": "application/json"}
if key:
    headers["Authorization"] = "Bearer " + key


def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


model = os.environ.get("SLOTKEEPER_TEST_MODEL") or call("/v1/models")["data"][0]["id"]
messages = [{"role": "user", "content": "Say hi."}]
answer = call("/v1/chat/completions", {"model": model, "max_tokens": 4, "messages": messages})
assert answer["choices"][0]["message"]["role"] == "assistant", answer
print("chat through", url, "with", model, "answered; usage", answer.get("usage"))
