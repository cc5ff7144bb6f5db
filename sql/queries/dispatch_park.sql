-- Finalize, step 5: park messages the broker refused for good, with the reason.
-- A parked message holds its key when its park_holds_key says so (the
-- retry policy of its target, set at ingest): the triggers then make it the
-- key's head, held, and the rest of the key waits for an operator. Otherwise
-- the head moves past it and the rest of the key goes on.
-- The id = ANY bound lets an index scan find the rows whatever the
-- statistics say (see migration 0003); IS TRUE keeps the state test from
-- offering deferred_message_key_order instead (see dispatch_delete.sql).
UPDATE deferred_message m
SET state = 'parked', reason = p.reason
FROM unnest($1::bigint[], $2::text[]) AS p (id, reason)
WHERE m.id = ANY ($1::bigint[]) AND m.id = p.id AND (m.state = 'pending') IS TRUE
