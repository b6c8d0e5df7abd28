"""Answer a query with this SuperNode's node config (what `starfed site start` passed)."""

import json

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    config = json.dumps(dict(context.node_config), sort_keys=True)
    return Message(RecordDict({"r": ConfigRecord({"node-config": config})}), reply_to=msg)
