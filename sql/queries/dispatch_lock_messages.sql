-- Finalize, step 1: lock the messages finalize will delete or park ($1), in
-- id order, before any key (step 2). Everyone takes locks in this order,
-- messages before keys and keys in key order: an operator's UPDATE or DELETE
-- locks messages and then, through the triggers, keys; ingest inserts new
-- messages and then locks keys. Without steps 1 and 2, finalize's delete,
-- park and release would take key locks one statement after another, and
-- could wait for a key while holding one that someone else waits for.
SELECT FROM deferred_message WHERE id = ANY ($1::bigint[]) ORDER BY id FOR UPDATE
