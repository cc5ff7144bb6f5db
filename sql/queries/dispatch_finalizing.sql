-- Finalize, step 3: say, for this transaction, which lease holder is
-- finalizing ($1, its owner name). The head trigger keeps the row of a key
-- left without messages while someone else holds its lease, emptied
-- (sql/schema/functions/deferred_key_refresh.sql), but deletes it at once
-- when the holder is the transaction's own finalize, which releases the key
-- after its changes: without this, every key whose last message a finalize
-- published would be emptied, then deleted, two writes instead of one.
SELECT FROM (SELECT set_config('scheduler.finalizing', $1::text, true)) s
