-- Finalize, step 3: the broker acknowledged these messages; forget them.
DELETE FROM deferred_message WHERE id = ANY ($1::bigint[]) AND state = 'pending'
