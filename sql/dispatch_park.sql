-- Finalize, step 4: park messages the broker refused for good, with the reason.
-- Parking moves the key's head past them, so they stop holding their key.
UPDATE deferred_message m
SET state = 'parked', reason = p.reason
FROM unnest($1::bigint[], $2::text[]) AS p (id, reason)
WHERE m.id = p.id AND m.state = 'pending'
