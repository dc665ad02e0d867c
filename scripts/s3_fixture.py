"""The S3 test server, its set-up and the tests' other S3 client (boto3, as the AWS CLI uploads).

  s3_fixture.py serve                      run moto's S3/IAM server on a loopback port the kernel
                                           picks, print that port, and serve until stdin closes
  s3_fixture.py setup ENDPOINT BUCKET...   create a user allowed s3:* on buckets named train*,
                                           its access key, and BUCKETs; print the key and secret
  s3_fixture.py put ENDPOINT KEY SECRET BUCKET PREFIX DIR
                                           upload every file under DIR to s3://BUCKET/PREFIX/...
  s3_fixture.py put-text ENDPOINT KEY SECRET BUCKET KEY TEXT [SHA256]
                                           put one object (with x-amz-meta-sha256: SHA256)
  s3_fixture.py get ENDPOINT KEY SECRET BUCKET KEY
                                           print the object's size and user metadata as JSON

The server binds its own port (port 0): a port picked by the test and bound later could be taken
by another test's server in between, and then two tests' set-ups would meet one server.
moto's server starts with INITIAL_NO_AUTH_ACTION_COUNT=3: the three IAM calls of `setup` are the
last ones it serves without checking credentials, signatures and policies.
"""
import json
import os
import sys

import boto3


def client(service, endpoint, key="setup", secret="setup"):
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=key, aws_secret_access_key=secret)


def serve():
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()  # the test holds stdin open for as long as it needs the server
    server.stop()


def setup(endpoint, buckets):
    iam = client("iam", endpoint)
    iam.create_user(UserName="trainer")
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": "s3:*",
        "Resource": ["arn:aws:s3:::train*", "arn:aws:s3:::train*/*"]}]}
    iam.put_user_policy(UserName="trainer", PolicyName="s3-train", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    s3 = client("s3", endpoint, key["AccessKeyId"], key["SecretAccessKey"])
    for bucket in buckets:
        s3.create_bucket(Bucket=bucket)
    print(json.dumps({"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}))


def put(endpoint, key, secret, bucket, prefix, root):
    s3 = client("s3", endpoint, key, secret)
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            s3.upload_file(path, bucket, f"{prefix}/{rel}" if prefix else rel)


def put_text(endpoint, key, secret, bucket, object_key, text, sha256=None):
    metadata = {"sha256": sha256} if sha256 else {}
    client("s3", endpoint, key, secret).put_object(
        Bucket=bucket, Key=object_key, Body=text.encode(), Metadata=metadata)


def get(endpoint, key, secret, bucket, object_key):
    head = client("s3", endpoint, key, secret).head_object(Bucket=bucket, Key=object_key)
    print(json.dumps({"size": head["ContentLength"], "metadata": head.get("Metadata", {})}))


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    {"serve": serve,
     "setup": lambda: setup(args[0], args[1:]),
     "put": lambda: put(*args),
     "put-text": lambda: put_text(*args),
     "get": lambda: get(*args)}[command]()
