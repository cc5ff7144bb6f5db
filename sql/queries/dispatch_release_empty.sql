-- Finalize, step 6, before the release: delete the emptied rows of the business
-- keys $1 leased to $2. A key is emptied when its last waiting message was
-- cancelled or parked with release while it was leased (see
-- sql/schema/functions/deferred_key_refresh.sql); its row kept the lease so
-- that a message arriving meanwhile would wait for this holder. If one did,
-- it is the head now (head_id is no longer 0) and the release frees it.
DELETE FROM deferred_key
WHERE business_key = ANY ($1::text[]) AND leased_by = $2::text AND head_id = 0
