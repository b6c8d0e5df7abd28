"""Send one query to every online SuperNode; print each reply's node config."""

import json
import time

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    min_nodes = int(context.run_config["min-nodes"])
    deadline = time.monotonic() + 120
    while len(node_ids := sorted(grid.get_node_ids())) < min_nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(node_ids)} SuperNodes online")
        time.sleep(0.5)
    messages = [
        Message(RecordDict({"q": ConfigRecord({"ask": 1})}), dst_node_id=n, message_type="query")
        for n in node_ids
    ]
    for reply in grid.send_and_receive(messages, timeout=120):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id}: {reply.error}")
        config = json.loads(str(reply.content["r"]["node-config"]))
        print(f"DEPLOY_APP node={reply.metadata.src_node_id} config={json.dumps(config)}")
