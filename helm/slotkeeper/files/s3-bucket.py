"""Init container of the gateway and node pods when the chart runs its own S3 (`s3.inCluster`): wait
until the endpoint answers, then create the bucket unless it is there. Every pod runs it, so creating
a bucket that exists is no error. It reads the pod's own S3 settings (the SLOTKEEPER_S3_* variables
the chart gives the container); one line per outcome, exit 1 when the bucket cannot be had within
BUCKET_WAIT_S seconds (the pod then restarts and tries again)."""

import os
import sys
import time

import boto3
from botocore.exceptions import BotoCoreError, ClientError

env = os.environ
endpoint, bucket = env["SLOTKEEPER_S3_ENDPOINT"], env["SLOTKEEPER_S3_BUCKET"]
client = boto3.client(
    "s3",
    endpoint_url=endpoint,
    region_name=env.get("SLOTKEEPER_S3_REGION") or "us-east-1",
    aws_access_key_id=env.get("SLOTKEEPER_S3_ACCESS_KEY"),
    aws_secret_access_key=env.get("SLOTKEEPER_S3_SECRET_KEY"),
)
deadline = time.monotonic() + float(env.get("BUCKET_WAIT_S") or 300)
while True:
    try:
        try:
            client.head_bucket(Bucket=bucket)
            print(f"bucket {bucket}: already at {endpoint}", flush=True)
            break
        except ClientError:  # missing (404; SeaweedFS says 403), or not ours: creating it says which
            client.create_bucket(Bucket=bucket)
            print(f"bucket {bucket}: created at {endpoint}", flush=True)
            break
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            print(f"bucket {bucket}: already at {endpoint}", flush=True)
            break
        last = f"{code}: {exc}"
    except BotoCoreError as exc:  # not answering yet: the S3 pod is starting
        last = f"{type(exc).__name__}: {exc}"
    if time.monotonic() > deadline:
        print(f"bucket {bucket} at {endpoint}: gave up: {last}", file=sys.stderr, flush=True)
        sys.exit(1)
    time.sleep(2)
